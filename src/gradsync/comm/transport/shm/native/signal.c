/* Signalling between the ranks of one host: doorbells, barriers and the fingerprint slots.
 *
 * Who writes which cache line, when, and who reads it
 *     rank r's first line     [0, 4) doorbell word: any rank that wants r to look again adds 256 to it
 *                             [4, 8) how many of r's threads sleep on it: r alone adds and subtracts
 *                             [8, 16) r's barrier count: r alone stores it; every peer polls it
 *     rank r's slot p & 1     r writes its fingerprint (64 bytes) before the barrier of agreement p;
 *                             the peers read it after that barrier. Slots alternate, so r rewrites
 *                             one two agreements later, when every peer has passed the barrier in
 *                             between and so has read it.
 *
 * A barrier: rank r stores count k into its counter (a sequentially consistent store, a full
 * fence), rings every peer's doorbell, then waits until every peer's counter is >= k. The counter
 * is the same one the Python transport's barriers use (waiting.py), so a rank in a native
 * collective and a rank in a Python one meet at the same barrier, and a mismatch between them is
 * still named by the fingerprints.
 *
 * Waiting, in three stages (the issue of every shared-memory protocol on a host whose cores may be
 * shared):
 *     poll     while every local rank has a core of its own, read the counters for up to
 *              spin_seconds (background_spin_seconds on a thread other than the main one, which
 *              shares its core with the main thread's work); with more ranks than cores, poll for
 *              up to yield_seconds, giving the core away (sched_yield) between looks: the rank
 *              waited for is likely queued on the same core
 *     sleep    FUTEX_WAIT on the own doorbell, in slices of at most slice_seconds
 *     report   once a slice has passed, call Python's on_slice(op, count, waited), with the GIL:
 *              it checks that the peers are alive and the group's timeout, and returns an error
 *              to raise, or None. Before raising, one more look: a peer may have arrived and
 *              exited while this rank slept.
 *
 * No wake-up is lost, in either of two ways of ringing.
 *     A barrier's ring (ring_if_asleep): the ringer stores its counter (a full fence), reads r's
 *     sleeper count, and only if it is above zero adds 256 to r's word and calls FUTEX_WAKE. The
 *     sleeper (wait_arrivals) reads the word (seen), checks the counters, adds 1 to its sleeper count
 *     (a locked instruction: a full fence), checks the counters again, and only then FUTEX_WAITs
 *     for a word other than seen, which the kernel compares under its own lock. Each side writes,
 *     fences, then reads what the other wrote, so at least one sees the other: the sleeper's second
 *     check sees the counter, or the ringer sees the sleeper and adds before it wakes, after the
 *     sleeper read seen, so the kernel's compare fails or the wake finds the sleeper queued. Most
 *     barriers find their peers polling: no write to their line at all, only a read.
 *     Python's rings and sleeps (ring_bell, sleep_on_bell, for the point-to-point rings' waits,
 *     whose conditions this file cannot check again): the ringer always adds 256 (locked: a full
 *     fence) before it reads the sleeper count, as doorbell.py's Python path always changes the
 *     word: if it reads zero sleepers, the word differs from any seen the sleeper read before the
 *     add, and a sleeper that read it after the add saw the ringer's state first.
 * Every ringer adds, none stores: values never repeat (2^24 rings would have to pass between a read
 * and a sleep).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "core.h"

#include <linux/futex.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

void ring_bell(uint32_t *word) {
    __atomic_fetch_add(word, 256u, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(word + 1, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, word, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
}

void sleep_on_bell(uint32_t *word, uint32_t seen, double seconds) {
    struct timespec timeout;
    if (seconds < 0)
        seconds = 0;
    timeout.tv_sec = (time_t)seconds;
    timeout.tv_nsec = (long)((seconds - (double)timeout.tv_sec) * 1e9);
    __atomic_fetch_add(word + 1, 1u, __ATOMIC_SEQ_CST);
    /* the result needs no check: every caller looks at its state again, whatever woke it */
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &timeout, NULL, 0);
    __atomic_fetch_sub(word + 1, 1u, __ATOMIC_SEQ_CST);
}

static void ring_if_asleep(uint32_t *word) {
    if (__atomic_load_n(word + 1, __ATOMIC_SEQ_CST)) {
        __atomic_fetch_add(word, 256u, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, word, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
    }
}

static int arrived(Core *core, uint64_t count) {
    for (int r = 0; r < core->n; r++)
        if (r != core->me && __atomic_load_n(core->counters[r], __ATOMIC_ACQUIRE) < count)
            return 0;
    return 1;
}

/* Ask Python what a wait of `waited` seconds means (see the file's opening): 0 go on waiting, 1 the
 * wait is over after all, -1 an error is set. Called with the GIL released; returns the same way. */
static int report(Core *core, PyObject *op, uint64_t count, double waited, PyThreadState **saved) {
    PyEval_RestoreThread(*saved);
    int outcome = 0;
    PyObject *answer = PyObject_CallFunction(core->on_slice, "OKd", op, (unsigned long long)count, waited);
    if (answer == NULL) {
        outcome = -1;
    } else if (answer != Py_None) {
        if (arrived(core, count)) {   /* one more look before a death is blamed */
            outcome = 1;
        } else {
            PyErr_SetObject((PyObject *)Py_TYPE(answer), answer);
            outcome = -1;
        }
    }
    Py_XDECREF(answer);
    *saved = PyEval_SaveThread();
    return outcome;
}

static int wait_arrivals(Core *core, uint64_t count, PyObject *op, int spin, PyThreadState **saved) {
    double started = now();
    if (spin) {
        double poll = !core->spin_allowed ? core->yield_seconds
                      : PyThread_get_thread_ident() == core->main_thread ? core->spin_seconds
                      : core->background_spin_seconds;
        double until = started + poll;
        do {
            for (int i = 0; i < 64; i++) {
                if (!core->spin_allowed)
                    sched_yield();
                if (arrived(core, count))
                    return 0;
                cpu_relax();
            }
        } while (now() < until);
    }
    uint32_t *bell = core->bells[core->me];
    double next_report = core->slice_seconds;
    for (;;) {
        uint32_t seen = __atomic_load_n(bell, __ATOMIC_SEQ_CST);
        if (arrived(core, count))
            return 0;
        double waited = now() - started;
        if (waited >= next_report) {
            int outcome = report(core, op, count, waited, saved);
            if (outcome != 0)
                return outcome > 0 ? 0 : -1;
            next_report = waited + core->slice_seconds;
        }
        hold_before_sleep(core);
        double seconds = next_report - waited;
        struct timespec timeout = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
        __atomic_fetch_add(bell + 1, 1u, __ATOMIC_SEQ_CST);
        if (!arrived(core, count))   /* the second check (see the file's opening) */
            syscall(SYS_futex, bell, FUTEX_WAIT, seen, &timeout, NULL, 0);
        __atomic_fetch_sub(bell + 1, 1u, __ATOMIC_SEQ_CST);
    }
}

int barrier(Core *core, PyObject *op, int spin, PyThreadState **saved) {
    uint64_t count = ++core->barriers;
    __atomic_store_n(core->counters[core->me], count, __ATOMIC_SEQ_CST);
    for (int r = 0; r < core->n; r++)
        if (r != core->me)
            ring_if_asleep(core->bells[r]);
    if (arrived(core, count))
        return 0;
    return wait_arrivals(core, count, op, spin, saved);
}

void publish(Core *core, const int64_t *values, uint64_t address) {
    char *slot = core->slots[core->me][++core->published & 1];
    memcpy(slot, values, 8 * sizeof(int64_t));
    memcpy(slot + FRAME, &address, sizeof address);
}

int first_differing(Core *core) {
    int parity = core->published & 1;
    const char *mine = core->slots[core->me][parity];
    for (int r = 0; r < core->n; r++)
        if (r != core->me && memcmp(core->slots[r][parity], mine, 8 * sizeof(int64_t)) != 0)
            return r;
    return -1;
}

int agree(Core *core, const int64_t *fingerprint, PyObject *op, int spin, PyThreadState **saved) {
    if (fingerprint != NULL)
        publish(core, fingerprint, 0);
    if (barrier(core, op, spin, saved) < 0)
        return -2;
    return fingerprint != NULL ? first_differing(core) : -1;
}
