/* Two-shot all-reduce: reduce-scatter then all-gather through the staging halves, piece by piece.
 *
 * The native twin of allreduce_two_shot.py's split all-reduce, above the one-shot band. Same regions,
 * same order, same bits; the pieces' phases run here without a Python operation between them.
 *
 * Vocabulary (allreduce_two_shot.py's)
 *     region j    R bytes at j x R of a staging half (R: region_bytes, a multiple of 64, so of every
 *                 dtype's size): what is staged for rank j, or on rank j itself its result
 *     piece       a run of at most N x R bytes of the tensor; slice j = ring_chunks(piece, N) chunk j
 *
 * Phases, per piece
 *     stage      rank r copies slice j of the piece into region j of its half, for every j != r (the
 *                first piece also publishes its fingerprint)
 *     barrier    every piece is staged (first piece: every rank compares every fingerprint)
 *     reduce     rank r folds region r of every other rank's half into slice r of its own tensor,
 *                its own first, then the others in rank order; avg divides by N; then it posts the
 *                result in region r of its own half
 *     barrier    every slice is reduced and posted
 *     gather     rank r copies region j of rank j's half into slice j of its tensor
 *
 * Why two barriers per piece are enough, and why the next split may use the same half with no
 * barrier in between: allreduce_two_shot.py says it, for the same memory.
 * Traffic: 2(N-1)/N x M per rank, as the ring's, nothing forwarded. Time per piece: two barriers
 * and about 2 x N x R bytes copied, the piece in cache.
 */
#include "core.h"

#include <string.h>

int allreduce_two_shot(Core *core, char *data, size_t numel, int dtype, int op, const int64_t *fingerprint,
                       PyObject *name, int spin, size_t region_bytes, PyThreadState **saved) {
    int n = core->n, me = core->me;
    size_t size = (size_t)dtype_size(dtype), region = region_bytes / size, piece_elems = (size_t)n * region;
    if (!core->split_in_half) {
        core->half ^= 1;
        core->split_in_half = 1;
    }
    int half = core->half;
    char *mine = core->stages[me][half];
    for (size_t start = 0; start < numel; start += piece_elems) {
        size_t length = numel - start < piece_elems ? numel - start : piece_elems;
        char *piece = data + start * size;
        // stage
        for (int j = 0; j < n; j++)
            if (j != me)
                memcpy(mine + j * region_bytes, piece + chunk_offset(length, n, j) * size,
                       chunk_size(length, n, j) * size);
        int other = agree(core, start == 0 ? fingerprint : NULL, name, spin, saved);
        if (other != -1)
            return other;
        // reduce, then post
        char *own = piece + chunk_offset(length, n, me) * size;
        size_t own_elems = chunk_size(length, n, me);
        const void *inputs[MAX_RANKS];
        int k = 0;
        inputs[k++] = own;   /* its own first, then the others in rank order */
        for (int j = 0; j < n; j++)
            if (j != me)
                inputs[k++] = core->stages[j][half] + me * region_bytes;
        reduce_inputs(dtype, op, own, inputs, n, own_elems, n);
        memcpy(mine + me * region_bytes, own, own_elems * size);
        if (barrier(core, name, spin, saved) < 0)
            return -2;
        // gather
        for (int j = 0; j < n; j++)
            if (j != me)
                memcpy(piece + chunk_offset(length, n, j) * size, core->stages[j][half] + j * region_bytes,
                       chunk_size(length, n, j) * size);
    }
    return -1;
}
