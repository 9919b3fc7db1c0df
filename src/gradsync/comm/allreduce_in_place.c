/* In-place all-reduce of a tensor that lies in a shared region: no staging copy.
 *
 * The native twin of allreduce_in_place.py (DDP's gradient buckets, torch DDP's adopted
 * buckets). views[j] is rank j's copy of the tensor, mapped here; slice j = ring_chunks(n, N)
 * chunk j, owned by rank j.
 *
 * Phases
 *     barrier   every rank's tensor is final and its fingerprint (with the region and offset)
 *               published; a difference is returned before anything is read
 *     reduce    rank r folds slice r of every other rank's tensor into slice r of its own, its own
 *               first then the others in rank order; avg divides by N
 *     scatter   rank r copies its finished slice r into slice r of every other rank's tensor
 *               (reduce and scatter go piece by piece, piece_bytes, so a piece is copied out while
 *               it is still in cache)
 *     barrier   every rank has scattered its slice: every tensor holds the whole result
 *
 * Why two barriers are enough: allreduce_in_place.py says it, for the same memory.
 * Traffic: 2(N-1)/N x M per rank.
 */
#include "core.h"

#include <string.h>

int allreduce_in_place(Core *core, char *data, char *const *views, size_t numel, int dtype, int op,
                       const int64_t *fingerprint, PyObject *name, int spin, size_t piece_bytes,
                       PyThreadState **saved) {
    int n = core->n, me = core->me;
    size_t size = (size_t)dtype_size(dtype);
    int other = agree(core, fingerprint, name, spin, saved);
    if (other != -1)
        return other;
    if (numel == 0)
        return -1;
    size_t own_start = chunk_offset(numel, n, me), own_elems = chunk_size(numel, n, me);
    size_t piece_elems = piece_bytes / size ? piece_bytes / size : 1;
    for (size_t start = 0; start < own_elems; start += piece_elems) {
        size_t length = own_elems - start < piece_elems ? own_elems - start : piece_elems;
        size_t at = (own_start + start) * size;
        char *piece = data + at;
        // reduce
        const void *inputs[MAX_RANKS];
        int k = 0;
        inputs[k++] = piece;   /* its own first, then the others in rank order */
        for (int j = 0; j < n; j++)
            if (j != me)
                inputs[k++] = views[j] + at;
        reduce_inputs(dtype, op, piece, inputs, n, length, n);
        // scatter
        for (int j = 0; j < n; j++)
            if (j != me)
                memcpy(views[j] + at, piece, length * size);
    }
    if (barrier(core, name, spin, saved) < 0)
        return -2;
    return -1;
}
