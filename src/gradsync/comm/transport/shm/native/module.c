/* gradsync's native shared-memory core, as Python sees it (gradsync.comm.transport.shm.native._core).
 *
 *     Core(...)                   one per shared-memory transport: the addresses of every local rank's
 *                                 barrier counter, doorbell, fingerprint slots and staging halves,
 *                                 the transport's counters (barriers, published, half, split_in_half:
 *                                 attributes Python's own waits and slots use too), how to wait, and
 *                                 on_slice(op, count, waited), which Python answers once a slice passed
 *     core.barrier(op, spin)      the transport's barrier (signal.c)
 *     core.hold_enter() -> bool, core.hold_leave(), core.hold_before_sleep()     (hold.c)
 *     core.plan(algorithm, numel, dtype, op, fingerprint, name, spin, hold, piece_bytes) -> Plan
 *                                 algorithm, dtype and op: the codes of core.h; fingerprint: its 8
 *                                 values (the second, the sequence number, is replaced at each
 *                                 run) or None
 *     plan.run(address, sequence[, views[, out]]) -> -1, or the first rank whose fingerprint differs
 *                                 (views: every rank's copy, for the in-place algorithms; out: the
 *                                 reduce-scatters' result)
 *     ring(word_address), sleep(word_address, seen, seconds)     a doorbell, for Python's waits
 *     set_narrow_half_sums(narrow)  float16/bfloat16 sums rounded after every add (reduce.c), or once
 *
 * Every wait runs with the GIL released; errors from on_slice are raised from the call.
 */
#include "core.h"

#include <string.h>
#include <structmember.h>

static PyObject *address_list(PyObject *sequence, int n, void **out, const char *what) {
    PyObject *fast = PySequence_Fast(sequence, what);
    if (fast == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "%s: expected %d addresses", what, n);
    }
    for (int i = 0; i < n; i++) {
        out[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == NULL && PyErr_Occurred()) {
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

static int Core_init(Core *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"n", "me", "counters", "bells", "slots", "stages", "stage_bytes", "spin_allowed",
                            "spin_seconds", "background_spin_seconds", "yield_seconds", "slice_seconds",
                            "main_thread", "own_core", "on_slice", NULL};
    PyObject *counters, *bells, *slots, *stages, *on_slice;
    Py_ssize_t stage_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiOOOOnpddddkiO", names, &self->n, &self->me, &counters,
                                     &bells, &slots, &stages, &stage_bytes, &self->spin_allowed,
                                     &self->spin_seconds, &self->background_spin_seconds, &self->yield_seconds,
                                     &self->slice_seconds, &self->main_thread, &self->own_core, &on_slice))
        return -1;
    if (self->n < 1 || self->n > MAX_RANKS || self->me < 0 || self->me >= self->n) {
        PyErr_Format(PyExc_ValueError, "Core: %d ranks (1..%d) with this one at %d", self->n, MAX_RANKS, self->me);
        return -1;
    }
    void *halves[2 * MAX_RANKS];
    PyObject *ok;
    if ((ok = address_list(counters, self->n, (void **)self->counters, "counters")) == NULL)
        return -1;
    Py_DECREF(ok);
    if ((ok = address_list(bells, self->n, (void **)self->bells, "bells")) == NULL)
        return -1;
    Py_DECREF(ok);
    if ((ok = address_list(slots, 2 * self->n, halves, "slots")) == NULL)
        return -1;
    Py_DECREF(ok);
    for (int r = 0; r < self->n; r++)
        for (int h = 0; h < 2; h++)
            self->slots[r][h] = halves[2 * r + h];
    if ((ok = address_list(stages, 2 * self->n, halves, "stages")) == NULL)
        return -1;
    Py_DECREF(ok);
    for (int r = 0; r < self->n; r++)
        for (int h = 0; h < 2; h++)
            self->stages[r][h] = halves[2 * r + h];
    self->stage_bytes = (size_t)stage_bytes;
    Py_INCREF(on_slice);
    Py_XSETREF(self->on_slice, on_slice);
    self->holder = 0;
    self->pinned = 0;
    return 0;
}

static void Core_dealloc(Core *self) {
    Py_XDECREF(self->on_slice);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Core_barrier(Core *self, PyObject *args) {
    PyObject *op;
    int spin;
    if (!PyArg_ParseTuple(args, "Op", &op, &spin))
        return NULL;
    PyThreadState *saved = PyEval_SaveThread();
    int failed = barrier(self, op, spin, &saved);
    PyEval_RestoreThread(saved);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_hold_enter(Core *self, PyObject *unused) { return PyBool_FromLong(hold_enter(self)); }
static PyObject *Core_hold_leave(Core *self, PyObject *unused) { hold_leave(self, 1); Py_RETURN_NONE; }
static PyObject *Core_hold_before_sleep(Core *self, PyObject *unused) { hold_before_sleep(self); Py_RETURN_NONE; }

/* ---- plans ------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Core *core;
    PyObject *name;
    int algorithm, dtype, op, spin, hold, has_fingerprint;
    size_t numel, piece_bytes;
    int64_t fingerprint[8];
} Plan;

static PyTypeObject PlanType;

static void Plan_dealloc(Plan *self) {
    Py_XDECREF(self->core);
    Py_XDECREF(self->name);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Plan_run(Plan *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 4)
        return PyErr_Format(PyExc_TypeError, "run(address, sequence[, views[, out]])");
    char *data = PyLong_AsVoidPtr(args[0]);
    long long sequence = PyLong_AsLongLong(args[1]);
    char *out = nargs > 3 ? PyLong_AsVoidPtr(args[3]) : NULL;
    if (PyErr_Occurred())
        return NULL;
    char *views[MAX_RANKS];
    Core *core = self->core;
    int algorithm = self->algorithm;
    if (algorithm == IN_PLACE || algorithm == REDUCE_SCATTER_IN_PLACE || algorithm == ALL_GATHER_IN_PLACE) {
        PyObject *ok;
        if (nargs < 3)
            return PyErr_Format(PyExc_TypeError, "an in-place plan runs with every rank's view");
        if ((ok = address_list(args[2], core->n, (void **)views, "views")) == NULL)
            return NULL;
        Py_DECREF(ok);
    }
    int64_t fingerprint[8];
    if (self->has_fingerprint) {
        memcpy(fingerprint, self->fingerprint, sizeof fingerprint);
        fingerprint[1] = sequence;
    }
    const int64_t *agreed = self->has_fingerprint ? fingerprint : NULL;
    int result;
    PyThreadState *saved = PyEval_SaveThread();
    int holding = self->hold && hold_enter(core);
    size_t numel = self->numel;
    int dtype = self->dtype, op = self->op, spin = self->spin;
    PyObject *name = self->name;
    switch (algorithm) {
    case ONE_SHOT:
        result = allreduce_one_shot(core, data, numel, dtype, op, agreed, name, spin, &saved);
        break;
    case TWO_SHOT:
        result = allreduce_two_shot(core, data, numel, dtype, op, agreed, name, spin, self->piece_bytes, &saved);
        break;
    case IN_PLACE:
        result = allreduce_in_place(core, data, views, numel, dtype, op, agreed, name, spin, self->piece_bytes,
                                    &saved);
        break;
    case REDUCE_SCATTER_STAGED:
        result = reduce_scatter_staged(core, data, out, numel, dtype, op, agreed, name, spin, &saved);
        break;
    case REDUCE_SCATTER_IN_PLACE:
        result = reduce_scatter_in_place(core, views, out, numel, dtype, op, agreed, name, spin, &saved);
        break;
    default:
        result = all_gather_in_place(core, views, numel, dtype, agreed, name, spin, &saved);
    }
    hold_leave(core, holding);
    PyEval_RestoreThread(saved);
    if (result == -2)
        return NULL;
    return PyLong_FromLong(result);
}

static PyObject *Core_plan(Core *self, PyObject *args) {
    int algorithm, dtype, op, spin, hold;
    Py_ssize_t numel, piece_bytes;
    PyObject *fingerprint, *name;
    if (!PyArg_ParseTuple(args, "iniiOOppn", &algorithm, &numel, &dtype, &op, &fingerprint, &name, &spin, &hold,
                          &piece_bytes))
        return NULL;
    if (algorithm < 0 || algorithm >= N_ALGORITHMS || dtype < 0 || dtype >= N_DTYPES || op < 0 || op >= N_OPS || numel < 0)
        return PyErr_Format(PyExc_ValueError, "plan: algorithm %d, dtype %d, op %d, %zd elements: not one the core "
                            "runs", algorithm, dtype, op, numel);
    if (algorithm == ONE_SHOT && (size_t)numel * (size_t)dtype_size(dtype) > self->stage_bytes)
        return PyErr_Format(PyExc_ValueError, "plan: a one-shot all-reduce of %zd bytes does not fit a %zu-byte "
                            "staging half", numel * dtype_size(dtype), self->stage_bytes);
    if (algorithm == TWO_SHOT && (piece_bytes <= 0 || piece_bytes % 64 || (size_t)piece_bytes * self->n > self->stage_bytes))
        return PyErr_Format(PyExc_ValueError, "plan: regions of %zd bytes for %d ranks do not fit a %zu-byte "
                            "staging half in multiples of 64", piece_bytes, self->n, self->stage_bytes);
    Plan *plan = PyObject_New(Plan, &PlanType);
    if (plan == NULL)
        return NULL;
    plan->core = self;
    Py_INCREF(self);
    plan->name = name;
    Py_INCREF(name);
    plan->algorithm = algorithm;
    plan->dtype = dtype;
    plan->op = op;
    plan->spin = spin;
    plan->hold = hold;
    plan->numel = (size_t)numel;
    plan->piece_bytes = (size_t)piece_bytes;
    plan->has_fingerprint = fingerprint != Py_None;
    if (plan->has_fingerprint) {
        PyObject *fast = PySequence_Fast(fingerprint, "fingerprint");
        if (fast == NULL || PySequence_Fast_GET_SIZE(fast) != 8) {
            Py_XDECREF(fast);
            Py_DECREF(plan);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "plan: a fingerprint is 8 values");
            return NULL;
        }
        for (int i = 0; i < 8; i++)
            plan->fingerprint[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        Py_DECREF(fast);
        if (PyErr_Occurred()) {
            Py_DECREF(plan);
            return NULL;
        }
    }
    return (PyObject *)plan;
}

static PyMethodDef Plan_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Plan_run, METH_FASTCALL, "run(address, sequence[, views]) -> -1 or a rank"},
    {NULL},
};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gradsync.comm.transport.shm.native._core.Plan",
    .tp_basicsize = sizeof(Plan),
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One all-reduce shape made ready (Core.plan).",
    .tp_methods = Plan_methods,
};

static PyMethodDef Core_methods[] = {
    {"barrier", (PyCFunction)Core_barrier, METH_VARARGS, "barrier(op, spin)"},
    {"hold_enter", (PyCFunction)Core_hold_enter, METH_NOARGS, "hold_enter() -> bool"},
    {"hold_leave", (PyCFunction)Core_hold_leave, METH_NOARGS, "hold_leave()"},
    {"hold_before_sleep", (PyCFunction)Core_hold_before_sleep, METH_NOARGS, "hold_before_sleep()"},
    {"plan", (PyCFunction)Core_plan, METH_VARARGS,
     "plan(algorithm, numel, dtype, op, fingerprint, name, spin, hold, piece_bytes) -> Plan"},
    {NULL},
};

static PyMemberDef Core_members[] = {
    {"barriers", T_ULONGLONG, offsetof(Core, barriers), 0, "barriers this rank has entered"},
    {"published", T_ULONGLONG, offsetof(Core, published), 0, "fingerprints this rank has published"},
    {"half", T_INT, offsetof(Core, half), 0, "the staging half used last"},
    {"split_in_half", T_INT, offsetof(Core, split_in_half), 0, "the two-shot all-reduce used that half last"},
    {"n", T_INT, offsetof(Core, n), READONLY, "local ranks"},
    {"me", T_INT, offsetof(Core, me), READONLY, "this rank's index"},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gradsync.comm.transport.shm.native._core.Core",
    .tp_basicsize = sizeof(Core),
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The native core of one shared-memory transport.",
    .tp_methods = Core_methods,
    .tp_members = Core_members,
    .tp_init = (initproc)Core_init,
    .tp_new = PyType_GenericNew,
};

static PyObject *module_ring(PyObject *unused, PyObject *address) {
    uint32_t *word = PyLong_AsVoidPtr(address);
    if (word == NULL && PyErr_Occurred())
        return NULL;
    ring_bell(word);
    Py_RETURN_NONE;
}

static PyObject *module_sleep(PyObject *unused, PyObject *args) {
    PyObject *address;
    unsigned int seen;
    double seconds;
    if (!PyArg_ParseTuple(args, "OId", &address, &seen, &seconds))
        return NULL;
    uint32_t *word = PyLong_AsVoidPtr(address);
    if (word == NULL && PyErr_Occurred())
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    sleep_on_bell(word, seen, seconds);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *module_set_narrow_half_sums(PyObject *unused, PyObject *flag) {
    int narrow = PyObject_IsTrue(flag);
    if (narrow < 0)
        return NULL;
    set_narrow_half_sums(narrow);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"ring", module_ring, METH_O, "ring(word_address): change the doorbell word and wake its sleepers"},
    {"set_narrow_half_sums", module_set_narrow_half_sums, METH_O,
     "set_narrow_half_sums(narrow): float16/bfloat16 sums rounded after every add (GRADSYNC_HALF_SUM=narrow)"},
    {"sleep", module_sleep, METH_VARARGS, "sleep(word_address, seen, seconds): until the word differs from seen"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_core", "gradsync's native shared-memory core (see module.c)", -1, module_methods,
};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&PlanType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "MAX_RANKS", MAX_RANKS);
    return m;
}
