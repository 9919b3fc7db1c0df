/* One-shot all-reduce: every rank stages its whole tensor, one barrier, every rank reduces all N.
 *
 * The native twin of allreduce_one_shot.py, for messages of one staging half or less (the
 * band where N x M is small: allreduce_two_shot.direct_below). Same memory, same order, same bits.
 *
 * Phases
 *     stage     rank r copies its M bytes into its next staging half h (halves alternate across
 *               calls: a rank may fill one while slower ranks still read the other)
 *     publish   its fingerprint into its next slot (the agreement travels with the data)
 *     barrier   every rank has staged and published
 *     compare   every peer's fingerprint with its own; the first that differs is returned, and
 *               Python raises the mismatch on every rank (nothing is reduced)
 *     reduce    one pass over N inputs in rank order into its tensor (its own input read from its
 *               tensor where the first fold reads it, from its staging half past that); avg
 *               divides by N
 *
 * Why one barrier is enough: rank r rewrites half h two calls later, after the barrier of the call
 * in between, which every peer enters only after it has reduced this call's inputs.
 * Traffic (bytes read out of other ranks' memory): (N-1) x M per rank. Memory traffic: read and
 * write M (stage), read N x M and write M (reduce). T = alpha + (N+2) x M / bandwidth.
 */
#include "core.h"

#include <string.h>

int allreduce_one_shot(Core *core, char *data, size_t numel, int dtype, int op, const int64_t *fingerprint,
                       PyObject *name, int spin, PyThreadState **saved) {
    size_t nbytes = numel * (size_t)dtype_size(dtype);
    core->half ^= 1;
    core->split_in_half = 0;
    int half = core->half, me = core->me;
    // stage, publish
    memcpy(core->stages[me][half], data, nbytes);
    int other = agree(core, fingerprint, name, spin, saved);
    if (other != -1)
        return other;
    // reduce
    if (nbytes) {
        const void *inputs[MAX_RANKS];
        for (int r = 0; r < core->n; r++)   /* its own from its tensor while the output has not overwritten it */
            inputs[r] = r == me && me < 2 ? data : core->stages[r][half];
        reduce_inputs(dtype, op, data, inputs, core->n, numel, core->n);
    }
    return -1;
}
