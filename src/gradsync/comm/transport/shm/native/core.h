/* The native core of the shared-memory transport: what its C files share.
 *
 * The core works on the memory the Python transport already maps (segment.py): every local rank's
 * segment is mapped in this process, so a peer's barrier counter, doorbell, fingerprint slots and
 * staging halves are plain addresses here. Nothing in this core allocates shared memory or knows a
 * file name; Python hands it the addresses once, when the transport connects (module.c, Core).
 *
 * Vocabulary (as the Python transport's)
 *     N, me        local ranks, this rank's index (the world is one host: every rank is local)
 *     counter      rank r's barrier count (u64 at byte 8 of r's segment): how many barriers r entered
 *     doorbell     rank r's u32 word at byte 0 and its sleeper count at byte 4 (signal.c)
 *     slot         rank r's fingerprint slot for the p-th agreement: slots[r][p & 1] (64 bytes, then
 *                  8 bytes further on, one FRAME later, the address of r's tensor for single-copy reads)
 *     half         rank r's staging half h (S bytes): stages[r][h]
 *
 * No torch headers: tensors arrive as addresses and element counts, so the core does not depend
 * on torch's ABI.
 */
#ifndef GRADSYNC_NATIVE_CORE_H
#define GRADSYNC_NATIVE_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stddef.h>

#define MAX_RANKS 64
#define FRAME 64

/* dtypes and operations the core reduces; everything else stays on the Python path */
enum dtype { F32, F64, F16, BF16, I32, I64, N_DTYPES };
enum op { SUM, AVG, MAX, MIN, N_OPS };
/* the collectives, one file each, in comm/ beside their Python variants */
enum algorithm { ONE_SHOT, TWO_SHOT, IN_PLACE, REDUCE_SCATTER_STAGED, REDUCE_SCATTER_IN_PLACE, ALL_GATHER_IN_PLACE,
                 N_ALGORITHMS };

typedef struct Core Core;

/* What a wait reports back to Python once a liveness slice has passed (signal.c). */
typedef struct {
    PyObject *op;          /* the operation's name, for the error */
    uint64_t count;        /* the barrier count waited for */
} WaitFor;

struct Core {
    PyObject_HEAD
    int n, me;
    volatile uint64_t *counters[MAX_RANKS];
    uint32_t *bells[MAX_RANKS];          /* the doorbell word; the sleeper count is the next u32 */
    char *slots[MAX_RANKS][2];
    char *stages[MAX_RANKS][2];
    size_t stage_bytes;
    /* the transport's counters (Python reads and writes them as attributes) */
    unsigned long long barriers, published, sequence;
    int half, split_in_half;
    /* waiting */
    int spin_allowed;                    /* a core per local rank: poll, else yield between polls */
    double spin_seconds, background_spin_seconds, yield_seconds, slice_seconds;
    unsigned long main_thread;
    PyObject *on_slice;                  /* on_slice(op, count, waited) -> None or an exception to raise */
    /* the hold of a collective's thread on this rank's core (hold.c) */
    int own_core;                        /* -1: no hold */
    unsigned long holder;                /* the thread that holds, 0 when none */
    int pinned;                          /* the holder was pinned, and its affinity kept in given_back */
    unsigned char given_back[128];       /* a cpu_set_t, kept opaque here */
};

/* ring_chunks(n, N), as allreduce_ring.py's: the first n mod N ranks get one element more.
 * N=3, n=10: chunks of 4, 3, 3 at 0, 4, 7. */
static inline size_t chunk_size(size_t n, int ranks, int j) { return n / ranks + ((size_t)j < n % ranks); }
static inline size_t chunk_offset(size_t n, int ranks, int j) {
    return (size_t)j * (n / ranks) + ((size_t)j < n % ranks ? (size_t)j : n % ranks);
}

/* signal.c: doorbells, barriers, waits */
void ring_bell(uint32_t *word);
void sleep_on_bell(uint32_t *word, uint32_t seen, double seconds);
int barrier(Core *core, PyObject *op, int spin, PyThreadState **saved);
int first_differing(Core *core);
void publish(Core *core, const int64_t *values, uint64_t address);
/* the staged agreement as a collective's first barrier: publish (when given), barrier, compare;
 * -1 all agree, a rank whose fingerprint differs, or -2 with a Python exception set */
int agree(Core *core, const int64_t *fingerprint, PyObject *op, int spin, PyThreadState **saved);

/* hold.c */
int hold_enter(Core *core);
void hold_before_sleep(Core *core);
void hold_leave(Core *core, int holding);

/* reduce.c: the reductions, in the Python path's order and rounding. reduce_inputs: out = inputs[0] (op)
 * inputs[1] (op) ... in that order, finished for n_ranks (avg divided); out may be inputs[0] or inputs[1].
 * set_narrow_half_sums(1): float16/bfloat16 sums rounded after every add (GRADSYNC_HALF_SUM=narrow) */
int dtype_size(int dtype);
void reduce_inputs(int dtype, int op, void *out, const void *const *inputs, int n_inputs, size_t n, int n_ranks);
void set_narrow_half_sums(int narrow);

/* the algorithms, each in comm/<name>.c beside its Python variant comm/<name>.py (setup.py builds both
 * folders into one module): each returns -1 when done, a rank whose fingerprint differs (>= 0), or -2 with a
 * Python exception set */
int allreduce_one_shot(Core *core, char *data, size_t numel, int dtype, int op, const int64_t *fingerprint,
                       PyObject *name, int spin, PyThreadState **saved);
int allreduce_two_shot(Core *core, char *data, size_t numel, int dtype, int op, const int64_t *fingerprint,
                       PyObject *name, int spin, size_t region_bytes, PyThreadState **saved);
int allreduce_in_place(Core *core, char *data, char *const *views, size_t numel, int dtype, int op,
                       const int64_t *fingerprint, PyObject *name, int spin, size_t piece_bytes,
                       PyThreadState **saved);
int reduce_scatter_staged(Core *core, char *data, char *out, size_t numel, int dtype, int op,
                          const int64_t *fingerprint, PyObject *name, int spin, PyThreadState **saved);
int reduce_scatter_in_place(Core *core, char *const *views, char *out, size_t numel, int dtype, int op,
                            const int64_t *fingerprint, PyObject *name, int spin, PyThreadState **saved);
int all_gather_in_place(Core *core, char *const *views, size_t numel, int dtype, const int64_t *fingerprint,
                        PyObject *name, int spin, PyThreadState **saved);

#endif
