/* Holding a collective's thread on its rank's core (the native twin of hold.py, sharing one state
 * with it: in a world with the native core, hold.py's CoreHold calls these).
 *
 * Lazily, as hold.py: a thread already on its core when it enters is pinned only when it is about
 * to sleep (a sleeping thread is woken wherever the scheduler likes); a thread found elsewhere is
 * pinned at once. One holder at a time: a collective entered while another holds (the same thread
 * nested, or a second thread) runs without taking the hold. The holder's own affinity is given
 * back when it leaves.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "core.h"

#include <sched.h>

_Static_assert(sizeof(cpu_set_t) <= sizeof(((Core *)0)->given_back), "cpu_set_t does not fit given_back");

static void pin(Core *core) {
    cpu_set_t *before = (cpu_set_t *)core->given_back, only;
    if (sched_getaffinity(0, sizeof(cpu_set_t), before) != 0)
        return;
    CPU_ZERO(&only);
    CPU_SET(core->own_core, &only);
    if (sched_setaffinity(0, sizeof only, &only) != 0)   /* the core was taken from this process (cpuset) */
        return;
    core->pinned = 1;
}

int hold_enter(Core *core) {
    unsigned long nobody = 0, me = PyThread_get_thread_ident();
    if (core->own_core < 0 || !__atomic_compare_exchange_n(&core->holder, &nobody, me, 0, __ATOMIC_ACQUIRE,
                                                           __ATOMIC_RELAXED))
        return 0;
    if (sched_getcpu() != core->own_core)
        pin(core);
    return 1;
}

void hold_before_sleep(Core *core) {
    if (!core->pinned && core->own_core >= 0 && core->holder == PyThread_get_thread_ident())
        pin(core);
}

void hold_leave(Core *core, int holding) {
    if (!holding)
        return;
    if (core->pinned) {
        sched_setaffinity(0, sizeof(cpu_set_t), (cpu_set_t *)core->given_back);
        core->pinned = 0;
    }
    __atomic_store_n(&core->holder, 0, __ATOMIC_RELEASE);
}
