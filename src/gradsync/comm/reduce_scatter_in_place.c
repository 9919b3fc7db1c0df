/* In-place reduce-scatter: inputs that lie in a shared region are read where they lie.
 *
 * The native twin of reduce_scatter_in_place.py (ShardedOptimizer's gradients). views[j] is rank
 * j's input, mapped here; chunk r = ring_chunks(n, N) chunk r, the result rank r returns (out).
 *
 * Phases
 *     barrier   every rank's input is final and its fingerprint published; a difference is
 *               returned before anything is read
 *     reduce    one pass: chunk r of its own input (op) chunk r of the others' in rank order, into
 *               out; avg divides by N (the staged and single-copy reduce-scatters' order: same bits)
 *     barrier   every rank has finished reading: only now may a rank's caller write its input again
 * Traffic: received from j = |chunk r|, sent to j = |chunk j|.
 */
#include "core.h"

int reduce_scatter_in_place(Core *core, char *const *views, char *out, size_t numel, int dtype, int op,
                            const int64_t *fingerprint, PyObject *name, int spin, PyThreadState **saved) {
    int n = core->n, me = core->me, other = agree(core, fingerprint, name, spin, saved);
    if (other != -1)
        return other;
    size_t size = (size_t)dtype_size(dtype), at = chunk_offset(numel, n, me) * size;
    size_t own_elems = chunk_size(numel, n, me);
    const void *inputs[MAX_RANKS];
    int k = 0;
    inputs[k++] = views[me] + at;   /* its own first, then the others in rank order */
    for (int j = 0; j < n; j++)
        if (j != me)
            inputs[k++] = views[j] + at;
    reduce_inputs(dtype, op, out, inputs, n, own_elems, n);
    return barrier(core, name, spin, saved) < 0 ? -2 : -1;
}
