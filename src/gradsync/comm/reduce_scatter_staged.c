/* Staged reduce-scatter: each rank stages its input, piece by piece, and reduces its own chunk.
 *
 * The native twin of reduce_scatter_staged.py (the "gradsync" backend's reduce_scatter_tensor, as
 * FSDP calls it). chunk r = ring_chunks(n, N) chunk r is rank r's result (out).
 *
 * Phases, per piece of S bytes (a staging half)
 *     stage     rank r copies the piece of its input into its next staging half (the first piece
 *               also publishes its fingerprint)
 *     barrier   every rank has staged it (first piece: a differing fingerprint is returned)
 *     reduce    the piece's part of chunk r: its own staged copy first, then the others' in rank
 *               order, into out
 * and at the end avg divides the whole chunk by N. No closing barrier: a half is rewritten two
 * pieces later, after the barrier of the piece between (allreduce_two_shot.py says why).
 * Traffic: received from j = |chunk r|, sent to j = |chunk j|.
 */
#include "core.h"

#include <string.h>

int reduce_scatter_staged(Core *core, char *data, char *out, size_t numel, int dtype, int op,
                          const int64_t *fingerprint, PyObject *name, int spin, PyThreadState **saved) {
    int n = core->n, me = core->me;
    size_t size = (size_t)dtype_size(dtype), piece = core->stage_bytes / size;
    size_t low = chunk_offset(numel, n, me), high = low + chunk_size(numel, n, me);
    for (size_t start = 0; start < (numel ? numel : 1); start += piece) {
        size_t length = numel - start < piece ? numel - start : piece;
        core->half ^= 1;
        core->split_in_half = 0;
        int half = core->half;
        // stage
        memcpy(core->stages[me][half], data + start * size, length * size);
        int other = agree(core, start == 0 ? fingerprint : NULL, name, spin, saved);
        if (other != -1)
            return other;
        // reduce
        size_t lo = low > start ? low : start, hi = high < start + length ? high : start + length;
        if (lo < hi) {
            const void *inputs[MAX_RANKS];
            int k = 0;
            inputs[k++] = core->stages[me][half] + (lo - start) * size;
            for (int j = 0; j < n; j++)
                if (j != me)
                    inputs[k++] = core->stages[j][half] + (lo - start) * size;
            reduce_inputs(dtype, op, out + (lo - low) * size, inputs, n, hi - lo, n);
        }
    }
    return -1;
}
