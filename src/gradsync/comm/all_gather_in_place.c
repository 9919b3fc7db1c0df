/* In-place all-gather: every rank's chunk already lies in its chunk of a shared-region tensor.
 *
 * The native twin of all_gather_in_place.py (ShardedOptimizer's parameters). views[j] is rank j's
 * copy of the tensor, mapped here; chunk j = ring_chunks(n, N) chunk j, written by rank j.
 *
 * Phases
 *     barrier   every rank's chunk is written and its fingerprint published
 *     copy      rank r copies chunk j of rank j's tensor into chunk j of its own, for every j != r
 *     barrier   every rank has finished copying: only now may a rank write its chunk again
 * Traffic: received from j = |chunk j|, sent to j = |chunk r|.
 */
#include "core.h"

#include <string.h>

int all_gather_in_place(Core *core, char *const *views, size_t numel, int dtype, const int64_t *fingerprint,
                        PyObject *name, int spin, PyThreadState **saved) {
    int n = core->n, me = core->me, other = agree(core, fingerprint, name, spin, saved);
    if (other != -1)
        return other;
    size_t size = (size_t)dtype_size(dtype);
    for (int j = 0; j < n; j++)
        if (j != me)
            memcpy(views[me] + chunk_offset(numel, n, j) * size, views[j] + chunk_offset(numel, n, j) * size,
                   chunk_size(numel, n, j) * size);
    return barrier(core, name, spin, saved) < 0 ? -2 : -1;
}
