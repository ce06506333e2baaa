/* Hearth's native CPU kernels for batch-1 decode (AVX-512 or AVX2, OpenMP); see hearth/native.
 *
 * 1. Matrix-vector products with int8 or bf16 weights: y[m, n] = bf16(s[n] * sum_k x[m, k] *
 *    w[n, k]) with x in bf16, one bf16 scale per int8 weight row (none for bf16), fp32
 *    products and sums. Decode reads every weight once per token, so they exist to run at
 *    memory bandwidth: each thread walks one contiguous range of rows, four at a time, and each
 *    16 weights are widened to fp32 once for all input rows. torch's kernels stream short rows
 *    (the 262144 x 640 head of Gemma 3 270M) at about half the bandwidth: the hardware
 *    prefetcher does not keep up, and the software prefetch below doubles the speed.
 * 2. The bf16 glue of a decode step (below the matrix-vector products), with torch's roundings.
 * 3. A whole Gemma 3 decoder layer at one token (last), composed of 1 and 2.
 *
 * Vectors are vec16 (vec16.h): one AVX-512 register or two AVX2 ones, the same arithmetic.
 * Built on first use by hearth/native/__init__.py (-O3 -march=native -fopenmp). OpenMP is then
 * served by the libgomp that torch has loaded already, so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

/* Weight rows per step: they share each load of x. */
#define ROWS 4
/* Input rows per step: with AVX-512, 4 x 4 accumulators plus 4 widened weights fit the 32
 * registers; AVX2's 16 hold one row's (a block of 4 weight rows is then reread from cache
 * for each input row). */
#define INPUT_ROWS (VEC16_REGISTERS >= 32 ? 4 : 1)
/* More input rows than this is a prefill, which runs as a dense GEMM instead. */
#define MAX_INPUT_ROWS 16
/* How far ahead of the loads the weight stream is prefetched, in bytes (measured best of
 * 4 KiB .. 32 KiB on the head; the exact value matters little past ~8 KiB). */
#define PREFETCH_BYTES 16384
/* Inputs up to this many fp32 values (64 KiB) are widened on the stack rather than the heap. */
#define STACK_FLOATS 16384

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float result;
    memcpy(&result, &bits, sizeof result);
    return result;
}

/* Round to nearest even, as torch's float -> bf16 conversion does; NaN stays a quiet NaN. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((bits >> 16) | 0x0040u);
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* 16 weights of row `row` from column j, widened to fp32 (exact), int8 or bf16; `count` of
 * them real (a row's tail). */
static inline vec16 load_weights(const void *w, int bf16, int64_t row, int64_t j,
                                 int64_t count) {
    if (bf16) {
        return vec16_load_bf16((const uint16_t *)w + row + j, count);
    }
    return vec16_load_i8((const int8_t *)w + row + j, count);
}

/* Prefetch the weight stream PREFETCH_BYTES ahead of column j of a block of ROWS rows. The
 * block's bytes are consumed in order, 16 weights of each row per step of j, so one prefetch
 * per 64 bytes covers the stream (prefetches never fault). */
static inline __attribute__((always_inline)) void prefetch_weights(const void *w, int bf16,
                                                                   int64_t j) {
    const int64_t weight_bytes = bf16 ? 2 : 1;
    const char *stream = (const char *)w + PREFETCH_BYTES;
    for (int64_t line = 0; line < weight_bytes; ++line) {
        _mm_prefetch(stream + (j * weight_bytes + line * 16) * ROWS, _MM_HINT_T0);
    }
}

/* out[r] = x . w[r] for one input row (a decode step) and the ROWS weight rows w[r] = w + r * k
 * (int8, or bf16 when `bf16`: a constant at each call, so the compiler builds one loop per
 * weight type). Four named accumulators, so they stay in registers on AVX2 too. */
static inline __attribute__((always_inline)) void dot_rows_one(const float *x, const void *w,
                                                               int bf16, int64_t k,
                                                               float out[ROWS]) {
    vec16 acc0 = vec16_zero(), acc1 = vec16_zero(), acc2 = vec16_zero(), acc3 = vec16_zero();
    for (int64_t j = 0; j < k; j += 16) {
        prefetch_weights(w, bf16, j);
        const int64_t count = k - j;
        const vec16 xv = vec16_load_f32(x + j, count);
        acc0 = vec16_fmadd(xv, load_weights(w, bf16, 0, j, count), acc0);
        acc1 = vec16_fmadd(xv, load_weights(w, bf16, k, j, count), acc1);
        acc2 = vec16_fmadd(xv, load_weights(w, bf16, 2 * k, j, count), acc2);
        acc3 = vec16_fmadd(xv, load_weights(w, bf16, 3 * k, j, count), acc3);
    }
    out[0] = vec16_sum(acc0);
    out[1] = vec16_sum(acc1);
    out[2] = vec16_sum(acc2);
    out[3] = vec16_sum(acc3);
}

/* out[i][r] = x[i] . w[r] as dot_rows_one, for input rows i < m (2..INPUT_ROWS): each 16
 * weights are widened once for all of them. */
static inline __attribute__((always_inline)) void dot_rows(const float *x, int64_t m,
                                                           const void *w, int bf16, int64_t k,
                                                           float out[INPUT_ROWS][ROWS]) {
    vec16 acc[INPUT_ROWS][ROWS];
    for (int i = 0; i < INPUT_ROWS; ++i) {
        for (int r = 0; r < ROWS; ++r) {
            acc[i][r] = vec16_zero();
        }
    }
    for (int64_t j = 0; j < k; j += 16) {
        prefetch_weights(w, bf16, j);
        const int64_t count = k - j;
        const vec16 w0 = load_weights(w, bf16, 0, j, count);
        const vec16 w1 = load_weights(w, bf16, k, j, count);
        const vec16 w2 = load_weights(w, bf16, 2 * k, j, count);
        const vec16 w3 = load_weights(w, bf16, 3 * k, j, count);
        for (int64_t i = 0; i < m; ++i) {
            const vec16 xv = vec16_load_f32(x + i * k + j, count);
            acc[i][0] = vec16_fmadd(xv, w0, acc[i][0]);
            acc[i][1] = vec16_fmadd(xv, w1, acc[i][1]);
            acc[i][2] = vec16_fmadd(xv, w2, acc[i][2]);
            acc[i][3] = vec16_fmadd(xv, w3, acc[i][3]);
        }
    }
    for (int64_t i = 0; i < m; ++i) {
        for (int r = 0; r < ROWS; ++r) {
            out[i][r] = vec16_sum(acc[i][r]);
        }
    }
}

/* y[:, first:first + rows] for one block of ROWS weight rows (`rows` of them real) and all m
 * input rows xf [m, k] (fp32). */
static inline __attribute__((always_inline)) void multiply_block(
    const float *xf, int64_t m, int64_t k, const void *weights, int bf16,
    const uint16_t *scales, int64_t first, int64_t rows, int64_t n, uint16_t *y) {
    float sums[INPUT_ROWS][ROWS];
    for (int64_t i0 = 0; i0 < m; i0 += INPUT_ROWS) {
        const int64_t chunk = m - i0 < INPUT_ROWS ? m - i0 : INPUT_ROWS;
        if (chunk == 1) {
            dot_rows_one(xf + i0 * k, weights, bf16, k, sums[0]);
        } else {
            dot_rows(xf + i0 * k, chunk, weights, bf16, k, sums);
        }
        for (int64_t i = 0; i < chunk; ++i) {
            for (int64_t r = 0; r < rows; ++r) {
                const float sum = sums[i][r];
                const float scaled = scales == NULL ? sum : sum * bf16_to_float(scales[first + r]);
                y[(i0 + i) * n + first + r] = float_to_bf16(scaled);
            }
        }
    }
}

/* y [m, n] = x [m, k] @ (w [n, k] * scales [n])^T on `threads` OpenMP threads, w int8 or bf16
 * (`bf16`); scales NULL: none. Returns 0, or -1 when m is outside 1..MAX_INPUT_ROWS or memory
 * runs out. */
static int rows_matmul(const uint16_t *x, int64_t m, int64_t k, const void *w, int bf16,
                       const uint16_t *scales, int64_t n, uint16_t *y, int threads) {
    const int64_t weight_bytes = bf16 ? 2 : 1;
    if (m < 1 || m > MAX_INPUT_ROWS || k < 1 || n < 1) {
        return -1;
    }
    /* x once in fp32 (on the stack when small: most calls); a last block short of ROWS
     * weight rows reads a zero-padded copy of them. */
    float stack_x[STACK_FLOATS];
    float *xf = m * k <= STACK_FLOATS ? stack_x : malloc(sizeof(float) * (size_t)(m * k));
    const int64_t row_bytes = k * weight_bytes;
    const int64_t blocks = (n + ROWS - 1) / ROWS;
    const int64_t tail_rows = n - (blocks - 1) * ROWS;
    char *last = NULL;
    if (tail_rows < ROWS) {
        last = calloc((size_t)(ROWS * row_bytes), 1);
    }
    if (xf == NULL || (tail_rows < ROWS && last == NULL)) {
        if (xf != stack_x) {
            free(xf);
        }
        free(last);
        return -1;
    }
    for (int64_t i = 0; i < m * k; ++i) {
        xf[i] = bf16_to_float(x[i]);
    }
    if (last != NULL) {
        memcpy(last, (const char *)w + (blocks - 1) * ROWS * row_bytes,
               (size_t)(tail_rows * row_bytes));
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t block = 0; block < blocks; ++block) {
        const int64_t first = block * ROWS;
        const int64_t rows = block == blocks - 1 ? tail_rows : ROWS;
        const void *weights = block == blocks - 1 && last != NULL
                                  ? (const void *)last
                                  : (const void *)((const char *)w + first * row_bytes);
        /* One specialised copy per weight type; the branch is taken once per block. */
        if (bf16) {
            multiply_block(xf, m, k, weights, 1, scales, first, rows, n, y);
        } else {
            multiply_block(xf, m, k, weights, 0, scales, first, rows, n, y);
        }
    }
    if (xf != stack_x) {
        free(xf);
    }
    free(last);
    return 0;
}

/* y [m, n] = x [m, k] @ (q [n, k] * scales [n])^T, q int8 and one bf16 scale per row. */
int hearth_int8_rows_matmul(const uint16_t *x, int64_t m, int64_t k, const int8_t *q,
                            const uint16_t *scales, int64_t n, uint16_t *y, int threads) {
    return rows_matmul(x, m, k, q, 0, scales, n, y, threads);
}

/* y [m, n] = x [m, k] @ w [n, k]^T, w bf16. */
int hearth_bf16_rows_matmul(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w,
                            int64_t n, uint16_t *y, int threads) {
    return rows_matmul(x, m, k, w, 1, NULL, n, y, threads);
}

/* ------------------------------------------------------------------------------------------
 * Decode glue in bf16, with the roundings of Hearth's torch references (hearth/kernels/norm.py,
 * rope.py): every op that torch runs in bf16 is an fp32 op rounded to bf16 here, in the same
 * order, so results differ from torch's only through the order of a sum (a last-bit effect).
 * One call replaces the dozen small torch ops of each step, whose dispatch dominated them.
 */

static inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

/* 1 / sqrt(mean(x^2) + eps) over h fp32 values, as torch's composite RMSNorm forms it. */
static float inverse_rms(const float *x, int64_t h, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t j = 0; j < h; ++j) {
        squares += x[j] * x[j];
    }
    return 1.0f / sqrtf(squares / (float)h + eps);
}

/* out = bf16((x * inverse_rms(x)) * w) for one row of h fp32 values (w NULL: no weight). */
static void rms_norm_row(const float *x, const float *w, int64_t h, float eps, float *out) {
    const float scale = inverse_rms(x, h, eps);
    for (int64_t j = 0; j < h; ++j) {
        const float normed = x[j] * scale;
        out[j] = round_bf16(w == NULL ? normed : normed * w[j]);
    }
}

static void widen_bf16(const uint16_t *x, int64_t count, float *out) {
    for (int64_t j = 0; j < count; ++j) {
        out[j] = bf16_to_float(x[j]);
    }
}

static void narrow_bf16(const float *x, int64_t count, uint16_t *out) {
    for (int64_t j = 0; j < count; ++j) {
        out[j] = float_to_bf16(x[j]);
    }
}

/* summed = (residual + norm(x) * w) * scale, the product rounded again (scale: one bf16
 * number, NULL for none); normed = norm(summed) * w_next (skipped when normed is NULL). */
static int add_rms_norm_scaled(const uint16_t *residual, const uint16_t *x, int64_t rows,
                               int64_t h, const float *w, const float *w_next, float eps,
                               const uint16_t *scale, uint16_t *summed, uint16_t *normed) {
    float *row = malloc(sizeof(float) * (size_t)(2 * h));
    if (row == NULL) {
        return -1;
    }
    float *work = row + h;
    for (int64_t i = 0; i < rows; ++i) {
        widen_bf16(x + i * h, h, row);
        rms_norm_row(row, w, h, eps, work);
        for (int64_t j = 0; j < h; ++j) {
            work[j] = round_bf16(bf16_to_float(residual[i * h + j]) + work[j]);
            if (scale != NULL) {
                work[j] = round_bf16(work[j] * bf16_to_float(*scale));
            }
        }
        narrow_bf16(work, h, summed + i * h);
        if (normed != NULL) {
            rms_norm_row(work, w_next, h, eps, row);
            narrow_bf16(row, h, normed + i * h);
        }
    }
    free(row);
    return 0;
}

/* The first index of a NaN in x [n], or else of its largest value. */
static int64_t first_nan_or_max(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (x[i] != x[i]) {
            return i;
        }
        best = x[i] > x[best] ? i : best;
    }
    return best;
}

/* As first_nan_or_max, in two vector passes where the row holds no NaN: its maximum (and its
 * sum, NaN iff a NaN is there or +inf meets -inf: then the scalar scan decides), then the first
 * block of 16 whose maximum is that value. */
static int64_t argmax_row(const float *x, int64_t n) {
    const int64_t whole = n - n % 16;
    vec16 top = vec16_set1(-INFINITY), total = vec16_zero();
    for (int64_t i = 0; i < whole; i += 16) {
        const vec16 values = vec16_load_f32(x + i, 16);
        top = vec16_max(top, values);
        total = vec16_add(total, values);
    }
    float best = vec16_max_lane(top), sum = vec16_sum(total);
    for (int64_t i = whole; i < n; ++i) {
        best = x[i] > best ? x[i] : best;
        sum += x[i];
    }
    if (sum != sum) {
        return first_nan_or_max(x, n);
    }
    for (int64_t i = 0; i < whole; i += 16) {
        if (vec16_max_lane(vec16_load_f32(x + i, 16)) == best) {
            for (int64_t j = i;; ++j) {
                if (x[j] == best) {
                    return j;
                }
            }
        }
    }
    for (int64_t i = whole; i < n; ++i) {
        if (x[i] == best) {
            return i;
        }
    }
    return first_nan_or_max(x, n); /* not reached: best is one of the values */
}

/* out[r] = the index of row r's largest value, the first on a tie; of its first NaN where it
 * holds one (torch.max's indices). x [rows, n] fp32, contiguous, n >= 1. */
int hearth_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; ++r) {
        out[r] = argmax_row(x + r * n, n);
    }
    return 0;
}

/* summed = residual + norm(x) * w; normed = norm(summed) * w_next (skipped when normed is NULL).
 * All of [rows, h] bf16, contiguous; w, w_next fp32 [h]. Returns -1 when memory runs out. */
int hearth_add_rms_norm(const uint16_t *residual, const uint16_t *x, int64_t rows, int64_t h,
                        const float *w, const float *w_next, float eps, uint16_t *summed,
                        uint16_t *normed) {
    return add_rms_norm_scaled(residual, x, rows, h, w, w_next, eps, NULL, summed, normed);
}

/* Rotate-half RoPE on one normed head (fp32 values of bf16 numbers), with bf16 cos/sin [d]:
 * out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = (-x2, x1). */
static void rope_row(const float *x, const uint16_t *cos, const uint16_t *sin, int64_t d,
                     uint16_t *out) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < d; ++j) {
        const float rotated = j < half ? -x[j + half] : x[j - half];
        const float straight = round_bf16(x[j] * bf16_to_float(cos[j]));
        const float turned = round_bf16(rotated * bf16_to_float(sin[j]));
        out[j] = float_to_bf16(straight + turned);
    }
}

/* For each of `tokens` rows of qkv [tokens, width] (bf16, row stride `width`): q heads and k
 * heads get RMSNorm (q_w / k_w, fp32 [d]) then RoPE with that token's cos/sin [tokens, d];
 * v heads are copied. q [tokens, q_heads, d], k and v [tokens, kv_heads, d], contiguous. */
int hearth_norm_rope(const uint16_t *qkv, int64_t tokens, int64_t width, int64_t q_heads,
                     int64_t kv_heads, int64_t d, const float *q_w, const float *k_w,
                     const uint16_t *cos, const uint16_t *sin, float eps, uint16_t *q, uint16_t *k,
                     uint16_t *v) {
    float *row = malloc(sizeof(float) * (size_t)(2 * d));
    if (row == NULL) {
        return -1;
    }
    float *normed = row + d;
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t *source = qkv + t * width;
        for (int64_t head = 0; head < q_heads + kv_heads; ++head) {
            const int is_q = head < q_heads;
            widen_bf16(source + head * d, d, row);
            rms_norm_row(row, is_q ? q_w : k_w, d, eps, normed);
            uint16_t *target = is_q ? q + (t * q_heads + head) * d
                                    : k + (t * kv_heads + head - q_heads) * d;
            rope_row(normed, cos + t * d, sin + t * d, d, target);
        }
        memcpy(v + t * kv_heads * d, source + (q_heads + kv_heads) * d,
               sizeof(uint16_t) * (size_t)(kv_heads * d));
    }
    free(row);
    return 0;
}

/* Keys per unit of attention work. Units are fixed by the length, not the thread count, and
 * merged in order, so the result does not depend on the threads. */
#define CHUNK_KEYS 128
/* Keys scored together, and 16-value slices of the output summed together: independent
 * accumulators in registers, so the FMAs' latency overlaps (one chain of 16 dependent FMAs per
 * score ran at a quarter of the FMA rate). */
#define KEY_BLOCK (VEC16_REGISTERS / 4)
#define VALUE_BLOCK (VEC16_REGISTERS / 4)

/* 16 K or V values from element `index` of a cache plane: bf16, or fp32 where `f32` (a constant
 * at each inlined call, so one loop is compiled per plane type). */
static inline __attribute__((always_inline)) vec16 load_kv(const void *plane, int f32,
                                                           int64_t index, int64_t count) {
    if (f32) {
        return vec16_load_f32((const float *)plane + index, count);
    }
    return vec16_load_bf16((const uint16_t *)plane + index, count);
}

/* Where a plane's keys lie: contiguous (`table` NULL: group g's slot t at g * group_stride +
 * t * d), or in blocks of a paged pool [num_blocks, kv_heads, block_size, d] (position p of
 * group g in block table[p / block_size] at slot p % block_size), read in the order of two runs
 * of positions: first[0].. (count[0] of them), then first[1].. (count[1]). */
typedef struct {
    const void *k, *v;
    int64_t group_stride;
    const int64_t *table;
    int64_t block_size, kv_heads;
    int64_t first[2], count[2];
} kv_layout;

/* The element offset of position (or, contiguous, slot) `p` of group `group` in a plane. */
static inline int64_t kv_at(const kv_layout *layout, int64_t group, int64_t p, int64_t d) {
    if (layout->table == NULL) {
        return group * layout->group_stride + p * d;
    }
    const int64_t block = layout->table[p / layout->block_size];
    return ((block * layout->kv_heads + group) * layout->block_size + p % layout->block_size) * d;
}

/* The element offset of the `t`-th key read (in reading order) of group `group`. */
static inline int64_t kv_key(const kv_layout *layout, int64_t group, int64_t t, int64_t d) {
    if (layout->table == NULL) {
        return kv_at(layout, group, t, d);
    }
    const int64_t p = t < layout->count[0] ? layout->first[0] + t
                                           : layout->first[1] + (t - layout->count[0]);
    return kv_at(layout, group, p, d);
}

/* One unit: each of the `per_group` query heads (fp32 `queries` [per_group, d]) of one KV head
 * over `count` keys, key t's row (and its value's) at element rows[t] of `keys` (`values`).
 * scores: [per_group, CHUNK_KEYS] room. Writes, per head, the chunk's largest score `top`, the
 * sum of exp(score - top) `total`, and `acc` [d] = the exp-weighted sum of the value rows. K/V
 * bf16, or fp32 where `f32`. Where the rows lie does not change a single operation: the sums
 * are the same whatever the layout. */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *queries, int64_t per_group, const void *keys, const void *values, int f32,
    int64_t d, const int64_t *rows, int64_t count, float scale, float *scores, float *top,
    float *total, float *acc) {
    for (int64_t g = 0; g < per_group; ++g) {
        const float *query = queries + g * d;
        float *row = scores + g * CHUNK_KEYS;
        for (int64_t t0 = 0; t0 < count; t0 += KEY_BLOCK) {
            /* A block past the last key rereads that key; its scores are dropped. */
            int64_t key[KEY_BLOCK];
            vec16 dots[KEY_BLOCK];
            for (int u = 0; u < KEY_BLOCK; ++u) {
                const int64_t t = t0 + u < count ? t0 + u : count - 1;
                key[u] = rows[t];
                dots[u] = vec16_zero();
            }
            for (int64_t j = 0; j < d; j += 16) {
                const vec16 qv = vec16_load_f32(query + j, d - j);
                for (int u = 0; u < KEY_BLOCK; ++u) {
                    dots[u] = vec16_fmadd(qv, load_kv(keys, f32, key[u] + j, d - j), dots[u]);
                }
            }
            for (int u = 0; u < KEY_BLOCK && t0 + u < count; ++u) {
                row[t0 + u] = vec16_sum(dots[u]) * scale;
            }
        }
        float best = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < count; ++t) {
            best = row[t] > best ? row[t] : best;
        }
        for (int64_t t = 0; t < count; ++t) {
            row[t] = expf(row[t] - best);
            sum += row[t];
        }
        top[g] = best;
        total[g] = sum;
        for (int64_t j0 = 0; j0 < d; j0 += 16 * VALUE_BLOCK) {
            vec16 sums[VALUE_BLOCK];
            int64_t lanes[VALUE_BLOCK]; /* 0 for a slice past d: loads nothing, stores nothing */
            for (int u = 0; u < VALUE_BLOCK; ++u) {
                lanes[u] = d - j0 - 16 * u;
                sums[u] = vec16_zero();
            }
            for (int64_t t = 0; t < count; ++t) {
                const vec16 weight = vec16_set1(row[t]);
                const int64_t value = rows[t] + j0;
                for (int u = 0; u < VALUE_BLOCK; ++u) {
                    const vec16 row_values = load_kv(values, f32, value + 16 * u, lanes[u]);
                    sums[u] = vec16_fmadd(weight, row_values, sums[u]);
                }
            }
            for (int u = 0; u < VALUE_BLOCK; ++u) {
                vec16_store_f32(acc + g * d + j0 + 16 * u, sums[u], lanes[u]);
            }
        }
    }
}

/* One query per head of each of `batch` sequences over its keys: for sequence b, result =
 * softmax(scale * q . K^T) @ V in fp32, from fp32 queries [groups, per_group, d] at
 * queries + b * query_stride (overwritten: they become the result) over lengths[b] keys laid
 * out as layouts[b] says, K/V bf16, or fp32 where `f32`. Each sequence's keys are cut into
 * chunks of CHUNK_KEYS; threads share the (sequence, KV head, chunk) units of all of them in
 * one parallel region, and each head's chunks are merged in order by the usual rescaling to
 * the largest score (as flash attention does): a sequence's result does not depend on the
 * others beside it. Returns -1 when memory runs out. */
static inline __attribute__((always_inline)) int attention_rows(
    float *queries, int64_t query_stride, const kv_layout *layouts, const int64_t *lengths,
    int64_t batch, int f32, int64_t groups, int64_t per_group, int64_t d, float scale,
    int threads) {
    const int64_t heads = groups * per_group;
    /* Per unit: scores, then per head (top, total) and acc [d]. */
    const int64_t unit_floats = per_group * (CHUNK_KEYS + 2 + d);
    /* Sequence b's units start at first_unit[b] (chunks[b] a KV head). */
    int64_t chunks[MAX_INPUT_ROWS], first_unit[MAX_INPUT_ROWS + 1];
    if (batch > MAX_INPUT_ROWS) {
        return -1;
    }
    first_unit[0] = 0;
    for (int64_t b = 0; b < batch; ++b) {
        chunks[b] = (lengths[b] + CHUNK_KEYS - 1) / CHUNK_KEYS;
        first_unit[b + 1] = first_unit[b] + groups * chunks[b];
    }
    const int64_t units = first_unit[batch];
    float *partials = malloc(sizeof(float) * (size_t)(units * unit_floats));
    if (partials == NULL) {
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (units > 1)
    for (int64_t unit = 0; unit < units; ++unit) {
        int64_t b = 0;
        while (unit >= first_unit[b + 1]) {
            ++b;
        }
        const kv_layout *layout = layouts + b;
        const int64_t own = unit - first_unit[b], length = lengths[b];
        const int64_t group = own / chunks[b], chunk = own % chunks[b];
        const int64_t first = chunk * CHUNK_KEYS;
        const int64_t count = length - first < CHUNK_KEYS ? length - first : CHUNK_KEYS;
        float *scores = partials + unit * unit_floats;
        float *top = scores + per_group * CHUNK_KEYS, *total = top + per_group;
        int64_t rows[CHUNK_KEYS];
        for (int64_t t = 0; t < count; ++t) {
            rows[t] = kv_key(layout, group, first + t, d);
        }
        attend_chunk(queries + b * query_stride + group * per_group * d, per_group, layout->k,
                     layout->v, f32, d, rows, count, scale, scores, top, total,
                     total + per_group);
    }
    for (int64_t b = 0; b < batch; ++b) {
        const float *own = partials + first_unit[b] * unit_floats;
        for (int64_t head = 0; head < heads; ++head) {
            const int64_t group = head / per_group, g = head % per_group;
            float best = -INFINITY, sum = 0.0f;
            for (int64_t chunk = 0; chunk < chunks[b]; ++chunk) {
                const float *top = own + (group * chunks[b] + chunk) * unit_floats +
                                   per_group * CHUNK_KEYS;
                best = top[g] > best ? top[g] : best;
            }
            /* this head's query is no longer needed */
            float *result = queries + b * query_stride + head * d;
            memset(result, 0, sizeof(float) * (size_t)d);
            for (int64_t chunk = 0; chunk < chunks[b]; ++chunk) {
                const float *top = own + (group * chunks[b] + chunk) * unit_floats +
                                   per_group * CHUNK_KEYS;
                const float *total = top + per_group, *acc = total + per_group + g * d;
                const float weight = expf(top[g] - best);
                sum += weight * total[g];
                for (int64_t j = 0; j < d; ++j) {
                    result[j] += weight * acc[j];
                }
            }
            for (int64_t j = 0; j < d; ++j) {
                result[j] = result[j] / sum;
            }
        }
    }
    free(partials);
    return 0;
}

/* attention_rows of one sequence of `length` keys. */
static inline __attribute__((always_inline)) int attention_heads(
    float *queries, const kv_layout *layout, int f32, int64_t groups, int64_t per_group,
    int64_t d, int64_t length, float scale, int threads) {
    return attention_rows(queries, 0, layout, &length, 1, f32, groups, per_group, d, scale,
                          threads);
}

/* One query per head, bf16 in and out (q, out: [groups, per_group, d] contiguous; k, v bf16):
 * attention_heads in fp32, rounded to bf16 once at the end. */
int hearth_decode_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                            int64_t groups, int64_t per_group, int64_t d, int64_t length,
                            int64_t group_stride, float scale, uint16_t *out, int threads) {
    const int64_t heads = groups * per_group;
    float *queries = malloc(sizeof(float) * (size_t)(heads * d));
    if (queries == NULL) {
        return -1;
    }
    widen_bf16(q, heads * d, queries);
    const kv_layout layout = {.k = k, .v = v, .group_stride = group_stride};
    const int status = attention_heads(queries, &layout, 0, groups, per_group, d, length, scale,
                                       threads);
    narrow_bf16(queries, heads * d, out);
    free(queries);
    return status;
}

/* As hearth_decode_attention with fp32 q, K/V and out (no rounding). */
int hearth_decode_attention_f32(const float *q, const float *k, const float *v, int64_t groups,
                                int64_t per_group, int64_t d, int64_t length,
                                int64_t group_stride, float scale, float *out, int threads) {
    memcpy(out, q, sizeof(float) * (size_t)(groups * per_group * d));
    const kv_layout layout = {.k = k, .v = v, .group_stride = group_stride};
    return attention_heads(out, &layout, 1, groups, per_group, d, length, scale, threads);
}

/* ------------------------------------------------------------------------------------------
 * One Gemma 3 decoder layer at one decode token, in a single call: the ops above in the order
 * of hearth/models/gemma3.py, with the same roundings, so the result equals the module path's
 * bit for bit. It replaces ~30 dispatched torch ops and ctypes calls a layer (~0.3 ms of a
 * ~20 ms step on the 270M) with one call.
 */

/* A layer's fixed operands (read-only). Each weight [n, k] is int8 with one bf16 scale per row,
 * or bf16 when its scales are NULL. Norm weights are fp32 [width], already 1 + w. */
typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, intermediate;
    const void *qkv, *o, *gate_up, *down;
    const uint16_t *qkv_scales, *o_scales, *gate_up_scales, *down_scales;
    const float *q_norm, *k_norm, *post_attention_norm, *pre_feedforward_norm;
    const float *post_feedforward_norm, *next_norm;
    float eps, scale;
} hearth_decode_layer;

static int project_row(const uint16_t *x, int64_t k, const void *w, const uint16_t *scales,
                       int64_t n, uint16_t *y, int threads) {
    if (scales == NULL) {
        return rows_matmul(x, 1, k, w, 1, NULL, n, y, threads);
    }
    return rows_matmul(x, 1, k, w, 0, scales, n, y, threads);
}

/* The end of an attention or MLP block, in place: x += norm(W · input) · w, then normed =
 * norm(x) · w_next. projected: [h] room. */
static int residual_branch(uint16_t *x, uint16_t *normed, const uint16_t *input, int64_t k,
                           const void *weight, const uint16_t *scales, int64_t h, const float *w,
                           const float *w_next, float eps, uint16_t *projected, int threads) {
    if (project_row(input, k, weight, scales, h, projected, threads) != 0) {
        return -1;
    }
    return hearth_add_rms_norm(x, projected, 1, h, w, w_next, eps, x, normed);
}

/* residual_branch, then the sum times a bf16 `scale` (rounded again) before its next norm. */
static int scaled_residual_branch(uint16_t *x, uint16_t *normed, const uint16_t *input,
                                  int64_t k, const void *weight, const uint16_t *scales,
                                  int64_t h, const float *w, const float *w_next, float eps,
                                  const uint16_t *scale, uint16_t *projected, int threads) {
    if (project_row(input, k, weight, scales, h, projected, threads) != 0) {
        return -1;
    }
    return add_rms_norm_scaled(x, projected, 1, h, w, w_next, eps, scale, x, normed);
}

/* out[j] = bf16(gelu_tanh(gate[j]) * up[j]), GELU looked up in torch's own table. */
static void geglu_row(const uint16_t *gate, const uint16_t *up, int64_t n,
                      const uint16_t *gelu_table, uint16_t *out) {
    for (int64_t j = 0; j < n; ++j) {
        out[j] = float_to_bf16(bf16_to_float(gelu_table[gate[j]]) * bf16_to_float(up[j]));
    }
}

/* A layer's middle, shared by Gemma 3 and 4: attention of the normed, rotated q [q_heads, d]
 * over cache slots 0..length-1, o projection, x += norm(.) * w and normed = its pre-MLP norm,
 * then the MLP's gate/up and GeGLU into activated [intermediate]. projected: [hidden] room;
 * gate_up: [2 * intermediate] room. */
static int attention_to_activation(const hearth_decode_layer *layer, const uint16_t *q,
                                   const uint16_t *keys, const uint16_t *values,
                                   int64_t head_stride, int64_t length, uint16_t *x,
                                   uint16_t *normed, uint16_t *attended, uint16_t *projected,
                                   uint16_t *gate_up, uint16_t *activated,
                                   const uint16_t *gelu_table, int threads) {
    const int64_t d = layer->head_dim, h = layer->hidden, inner = layer->intermediate;
    if (hearth_decode_attention(q, keys, values, layer->kv_heads, layer->q_heads / layer->kv_heads,
                                d, length, head_stride, layer->scale, attended, threads) != 0 ||
        residual_branch(x, normed, attended, layer->q_heads * d, layer->o, layer->o_scales, h,
                        layer->post_attention_norm, layer->pre_feedforward_norm, layer->eps,
                        projected, threads) != 0 ||
        project_row(normed, h, layer->gate_up, layer->gate_up_scales, 2 * inner, gate_up,
                    threads) != 0) {
        return -1;
    }
    geglu_row(gate_up, gate_up + inner, inner, gelu_table, activated);
    return 0;
}

/* x [hidden] (the residual stream) and normed [hidden] (its input norm) are updated in place:
 * x becomes the layer's output, normed its norm by next_norm. cos, sin: bf16 [head_dim] of this
 * position. The new K and V go into slot `slot` of the cache planes `keys`, `values`
 * (head h's slot t at h * head_stride + t * head_dim, bf16); attention then reads slots
 * 0..length-1. gelu_table: bf16 gelu_tanh of every bf16 bit pattern (made by torch's own
 * F.gelu, so GeGLU rounds as torch does by construction). Returns -1 when memory runs out. */
int hearth_gemma3_decode_layer(const hearth_decode_layer *layer, uint16_t *x, uint16_t *normed,
                               const uint16_t *cos, const uint16_t *sin, uint16_t *keys,
                               uint16_t *values, int64_t head_stride, int64_t slot,
                               int64_t length, const uint16_t *gelu_table, int threads) {
    const int64_t d = layer->head_dim, h = layer->hidden, inner = layer->intermediate;
    const int64_t q_width = layer->q_heads * d, kv_width = layer->kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    uint16_t *work = malloc(sizeof(uint16_t) *
                            (size_t)(qkv_width + 2 * q_width + 2 * kv_width + h + 3 * inner));
    if (work == NULL) {
        return -1;
    }
    uint16_t *qkv = work, *q = qkv + qkv_width, *k = q + q_width, *v = k + kv_width;
    uint16_t *attended = v + kv_width, *projected = attended + q_width;
    uint16_t *gate_up = projected + h, *activated = gate_up + 2 * inner;
    int status = -1;
    if (project_row(normed, h, layer->qkv, layer->qkv_scales, qkv_width, qkv, threads) != 0 ||
        hearth_norm_rope(qkv, 1, qkv_width, layer->q_heads, layer->kv_heads, d, layer->q_norm,
                         layer->k_norm, cos, sin, layer->eps, q, k, v) != 0) {
        goto done;
    }
    for (int64_t head = 0; head < layer->kv_heads; ++head) {
        memcpy(keys + head * head_stride + slot * d, k + head * d, sizeof(uint16_t) * (size_t)d);
        memcpy(values + head * head_stride + slot * d, v + head * d, sizeof(uint16_t) * (size_t)d);
    }
    if (attention_to_activation(layer, q, keys, values, head_stride, length, x, normed,
                                attended, projected, gate_up, activated, gelu_table,
                                threads) != 0) {
        goto done;
    }
    status = residual_branch(x, normed, activated, inner, layer->down, layer->down_scales, h,
                             layer->post_feedforward_norm, layer->next_norm, layer->eps,
                             projected, threads);
done:
    free(work);
    return status;
}

/* A Gemma 4 dense layer's fixed operands (read-only): hearth_decode_layer's, plus how V is
 * made (value_mode: 0 none, a KV-sharing layer that reads its donor's cache; 2 the V projection
 * RMS-normalised without weight; 3 the raw K projection so normalised, on k_eq_v layers), the
 * per-layer input's gate [ple, hidden] and projection [hidden, ple] with the norm after it
 * (ple = 0: none), and the bf16 layer scalar. Norm weights are fp32 w (Gemma 4 has no 1 + w). */
typedef struct {
    hearth_decode_layer base; /* k_norm NULL on a KV-sharing layer */
    int64_t per_layer, value_mode;
    const void *per_layer_gate, *per_layer_projection;
    const uint16_t *per_layer_gate_scales, *per_layer_projection_scales;
    const float *post_per_layer_norm;
    const uint16_t *layer_scalar;
} hearth_gemma4_layer;

/* q heads: RMSNorm by q_w, then RoPE, into q [q_heads, d]. With a value_mode, k heads: RMSNorm
 * by k_w and RoPE, and V made as value_mode says, written into slot `slot` of the cache planes
 * (hearth.ops.rope.norm_rope_reference, one token). */
static int gemma4_norm_rope(const hearth_gemma4_layer *gemma4, const uint16_t *qkv,
                            const uint16_t *cos, const uint16_t *sin, uint16_t *q, uint16_t *keys,
                            uint16_t *values, int64_t head_stride, int64_t slot) {
    const hearth_decode_layer *layer = &gemma4->base;
    const int64_t d = layer->head_dim, kv_start = layer->q_heads * d;
    float *row = malloc(sizeof(float) * (size_t)(2 * d));
    if (row == NULL) {
        return -1;
    }
    float *normed = row + d;
    for (int64_t head = 0; head < layer->q_heads; ++head) {
        widen_bf16(qkv + head * d, d, row);
        rms_norm_row(row, layer->q_norm, d, layer->eps, normed);
        rope_row(normed, cos, sin, d, q + head * d);
    }
    for (int64_t head = 0; gemma4->value_mode != 0 && head < layer->kv_heads; ++head) {
        uint16_t *key = keys + head * head_stride + slot * d;
        uint16_t *value = values + head * head_stride + slot * d;
        widen_bf16(qkv + kv_start + head * d, d, row);
        rms_norm_row(row, layer->k_norm, d, layer->eps, normed);
        rope_row(normed, cos, sin, d, key);
        if (gemma4->value_mode == 2) { /* else 3: V from the raw K still in `row` */
            widen_bf16(qkv + kv_start + (layer->kv_heads + head) * d, d, row);
        }
        rms_norm_row(row, NULL, d, layer->eps, normed);
        narrow_bf16(normed, d, value);
    }
    free(row);
    return 0;
}

/* One Gemma 4 dense layer at one token, in place, as hearth_gemma3_decode_layer: x becomes the
 * layer's output, normed its norm by next_norm. A layer that owns K/V writes them into slot
 * `slot` of keys/values; a KV-sharing one (value_mode 0, slot ignored) reads its donor's
 * planes. Attention reads slots 0..length-1. per_layer_input: bf16 [per_layer] (NULL without).
 * The order and roundings are hearth.models.gemma4's: attention, add + norm, GeGLU MLP, then
 * either add + scale + next norm, or add, the per-layer input's GeGLU update, add + scale +
 * next norm. Returns -1 when memory runs out. */
int hearth_gemma4_decode_layer(const hearth_gemma4_layer *gemma4, uint16_t *x, uint16_t *normed,
                               const uint16_t *cos, const uint16_t *sin, uint16_t *keys,
                               uint16_t *values, int64_t head_stride, int64_t slot,
                               int64_t length, const uint16_t *per_layer_input,
                               const uint16_t *gelu_table, int threads) {
    const hearth_decode_layer *layer = &gemma4->base;
    const int64_t d = layer->head_dim, h = layer->hidden, inner = layer->intermediate;
    const int64_t ple = gemma4->per_layer, q_width = layer->q_heads * d;
    const int64_t kv_parts = gemma4->value_mode == 0 ? 0 : gemma4->value_mode == 3 ? 1 : 2;
    const int64_t qkv_width = q_width + kv_parts * layer->kv_heads * d;
    uint16_t *work = malloc(sizeof(uint16_t) *
                            (size_t)(qkv_width + 2 * q_width + h + 3 * inner + 2 * ple));
    if (work == NULL) {
        return -1;
    }
    uint16_t *qkv = work, *q = qkv + qkv_width, *attended = q + q_width;
    uint16_t *projected = attended + q_width, *gate_up = projected + h;
    uint16_t *activated = gate_up + 2 * inner, *ple_gate = activated + inner;
    uint16_t *ple_activated = ple_gate + ple;
    int status = -1;
    if (project_row(normed, h, layer->qkv, layer->qkv_scales, qkv_width, qkv, threads) != 0 ||
        gemma4_norm_rope(gemma4, qkv, cos, sin, q, keys, values, head_stride, slot) != 0 ||
        attention_to_activation(layer, q, keys, values, head_stride, length, x, normed,
                                attended, projected, gate_up, activated, gelu_table,
                                threads) != 0) {
        goto done;
    }
    if (ple == 0) {
        status = scaled_residual_branch(x, normed, activated, inner, layer->down,
                                        layer->down_scales, h, layer->post_feedforward_norm,
                                        layer->next_norm, layer->eps, gemma4->layer_scalar,
                                        projected, threads);
        goto done;
    }
    if (residual_branch(x, NULL, activated, inner, layer->down, layer->down_scales, h,
                        layer->post_feedforward_norm, NULL, layer->eps, projected, threads) != 0 ||
        project_row(x, h, gemma4->per_layer_gate, gemma4->per_layer_gate_scales, ple, ple_gate,
                    threads) != 0) {
        goto done;
    }
    geglu_row(ple_gate, per_layer_input, ple, gelu_table, ple_activated);
    status = scaled_residual_branch(x, normed, ple_activated, ple, gemma4->per_layer_projection,
                                    gemma4->per_layer_projection_scales, h,
                                    gemma4->post_per_layer_norm, layer->next_norm, layer->eps,
                                    gemma4->layer_scalar, projected, threads);
done:
    free(work);
    return status;
}

/* ---------------------------------------------------------------------------------------------
 * 4. Conversions, each bit for bit as the torch code it replaces computes it: at load
 *    (hearth.checkpoint.gguf.dequantize_q8_0 then a cast; hearth.quant.cpu.quantize_int8_rows),
 *    which streams every weight through both, and int8 -> bf16 for a prefill's GEMM. torch's
 *    versions ran at ~0.3 GB/s and made a prefill spend most of its time unpacking weights.
 */

/* GGML block formats -> bf16, as the `gguf` package's numpy dequantization computes each value
 * in fp32 (products and differences rounded one at a time: no fused multiply-add, hence the
 * attribute), then rounded to bf16 once. Block layouts are llama.cpp's (ggml-common.h). */
enum { GGML_Q4_0 = 2, GGML_Q5_0 = 6, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q6_K = 14 };

static inline float half_at(const uint8_t *p) {
    uint16_t half;
    memcpy(&half, p, sizeof half);
    return _cvtsh_ss(half);
}

/* GCC fuses a * b - c into one FMA unless told not to, per function; clang reads the pragma. */
#pragma STDC FP_CONTRACT OFF
#define NO_FMA __attribute__((optimize("fp-contract=off")))

/* Q8_0 (34 bytes, 32 values): fp16 d, int8 q[32]: d * q. */
NO_FMA static void q8_0_block(const uint8_t *block, uint16_t *out) {
    const vec16 scale = vec16_set1(half_at(block));
    for (int part = 0; part < 2; ++part) {
        const vec16 codes = vec16_load_i8((const int8_t *)(block + 2 + 16 * part), 16);
        vec16_store_bf16(out + 16 * part, vec16_mul(codes, scale), 16);
    }
}

/* Q4_0 (18 bytes, 32 values): fp16 d, nibbles (low: values 0-15, high: 16-31): d * (q - 8). */
NO_FMA static void q4_0_block(const uint8_t *block, uint16_t *out) {
    const float d = half_at(block);
    const uint8_t *qs = block + 2;
    for (int i = 0; i < 16; ++i) {
        out[i] = float_to_bf16(d * (float)((int)(qs[i] & 0x0f) - 8));
        out[i + 16] = float_to_bf16(d * (float)((int)(qs[i] >> 4) - 8));
    }
}

/* Q5_0 (22 bytes, 32 values): fp16 d, 32 high bits (little-endian), nibbles as Q4_0:
 * d * ((nibble | high bit << 4) - 16). */
NO_FMA static void q5_0_block(const uint8_t *block, uint16_t *out) {
    const float d = half_at(block);
    uint32_t high;
    memcpy(&high, block + 2, sizeof high);
    const uint8_t *qs = block + 6;
    for (int i = 0; i < 16; ++i) {
        const int low = (int)(qs[i] & 0x0f) | (int)(((high >> i) & 1u) << 4);
        const int upper = (int)(qs[i] >> 4) | (int)(((high >> (i + 16)) & 1u) << 4);
        out[i] = float_to_bf16(d * (float)(low - 16));
        out[i + 16] = float_to_bf16(d * (float)(upper - 16));
    }
}

/* Q4_K (144 bytes, 256 values): fp16 d and dmin, 12 bytes of 6-bit scales and mins for eight
 * sub-blocks of 32, then 128 bytes of nibbles (each 32 bytes: low nibbles one sub-block, high
 * the next): (d * scale) * q - dmin * min. */
NO_FMA static void q4_k_block(const uint8_t *block, uint16_t *out) {
    const float d = half_at(block), dmin = half_at(block + 2);
    const uint8_t *packed = block + 4, *qs = block + 16;
    for (int j = 0; j < 8; ++j) {
        int scale, min;
        if (j < 4) {
            scale = packed[j] & 0x3f;
            min = packed[j + 4] & 0x3f;
        } else {
            scale = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 2) & 0x30);
            min = (packed[j + 4] >> 4) | ((packed[j] >> 2) & 0x30);
        }
        const float step = d * (float)scale, offset = dmin * (float)min;
        const uint8_t *bytes = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 32; ++i) {
            const float product = step * (float)((bytes[i] >> shift) & 0x0f);
            out[32 * j + i] = float_to_bf16(product - offset);
        }
    }
}

/* Q6_K (210 bytes, 256 values): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales
 * (one per 16 values), fp16 d: (d * scale) * (q - 32), in llama.cpp's interleaving. */
NO_FMA static void q6_k_block(const uint8_t *block, uint16_t *out) {
    const uint8_t *ql = block, *qh = block + 128;
    const int8_t *scales = (const int8_t *)(block + 192);
    const float d = half_at(block + 208);
    for (int half = 0; half < 2; ++half) {
        for (int group = 0; group < 4; ++group) { /* 32 values each */
            const uint8_t *low = ql + 64 * half + 32 * (group % 2);
            const int low_shift = 4 * (group / 2), high_shift = 2 * group;
            for (int i = 0; i < 32; ++i) {
                const int index = 128 * half + 32 * group + i;
                const int q = (((low[i] >> low_shift) & 0x0f) |
                               (((qh[32 * half + i] >> high_shift) & 0x03) << 4)) - 32;
                out[index] = float_to_bf16((d * (float)scales[index / 16]) * (float)q);
            }
        }
    }
}

/* n_blocks blocks of GGML type `type` -> bf16 values in order. Returns -1 for a type not
 * handled here (the caller keeps the `gguf` package's dequantization). */
int hearth_blocks_to_bf16(int type, const uint8_t *blocks, int64_t n_blocks, uint16_t *out,
                          int threads) {
    void (*decode)(const uint8_t *, uint16_t *);
    int64_t bytes, values;
    switch (type) {
    case GGML_Q8_0: decode = q8_0_block, bytes = 34, values = 32; break;
    case GGML_Q4_0: decode = q4_0_block, bytes = 18, values = 32; break;
    case GGML_Q5_0: decode = q5_0_block, bytes = 22, values = 32; break;
    case GGML_Q4_K: decode = q4_k_block, bytes = 144, values = 256; break;
    case GGML_Q6_K: decode = q6_k_block, bytes = 210, values = 256; break;
    default: return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
        decode(blocks + b * bytes, out + b * values);
    }
    return 0;
}

/* Symmetric int8 per row of a bf16 matrix [rows, cols]: s = the smallest bf16 >= max(|w| / 127,
 * floor); q = clamp(round_half_even(w / s), -127, 127). Weights must be finite. */
int hearth_quantize_int8_rows(const uint16_t *weight, int64_t rows, int64_t cols, float floor_,
                              int8_t *codes, uint16_t *scales, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *row = weight + r * cols;
        vec16 amax = vec16_zero();
        for (int64_t j = 0; j < cols; j += 16) {
            amax = vec16_max(amax, vec16_abs(vec16_load_bf16(row + j, cols - j)));
        }
        float scale = vec16_max_lane(amax) / 127.0f;
        scale = scale < floor_ ? floor_ : scale;
        uint16_t stored = float_to_bf16(scale);
        if (bf16_to_float(stored) < scale) {
            stored += 1; /* positive: the next bf16 up */
        }
        scales[r] = stored;
        const vec16 divisor = vec16_set1(bf16_to_float(stored));
        const vec16 low = vec16_set1(-127.0f), high = vec16_set1(127.0f);
        for (int64_t j = 0; j < cols; j += 16) {
            vec16 v = vec16_div(vec16_load_bf16(row + j, cols - j), divisor);
            v = vec16_min(vec16_max(vec16_round_even(v), low), high);
            vec16_store_i8(codes + r * cols + j, v, cols - j);
        }
    }
    return 0;
}

/* bf16(q * s) of an int8 matrix [rows, cols] with one bf16 scale per row: the fp32 product is
 * exact (8 + 8 significant bits), then rounded once; a prefill's dense GEMM reads the result. */
int hearth_int8_rows_to_bf16(const int8_t *codes, const uint16_t *scales, int64_t rows,
                             int64_t cols, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const vec16 scale = vec16_set1(bf16_to_float(scales[r]));
        for (int64_t j = 0; j < cols; j += 16) {
            const vec16 q = vec16_load_i8(codes + r * cols + j, cols - j);
            vec16_store_bf16(out + r * cols + j, vec16_mul(q, scale), cols - j);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * GGML blocks computed on as stored (hearth.layers.gguf): decode GEMV with fp32 activations and
 * fp32 dequantization of whole rows (a prefill's tiles), for every type of
 * hearth/quant/gguf_blocks.py. Each block unpacks into int8 codes and, per group of 16 or 32
 * values, an fp32 step and offset: w = fl(fl(step * q) - offset), the `gguf` package's value
 * (offset 0 for the symmetric types; x - 0 = x). Where a type has an offset, step * q is exact
 * (at most 17 + 5 significant bits), so a compiler contracting the two into one FMA cannot
 * change w; the dot products then add fma(x, w) in fp32.
 */
enum { GGML_Q4_1 = 3, GGML_Q5_1 = 7, GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q5_K = 13 };
#define BLOCK_MAX_VALUES 256
#define BLOCK_MAX_GROUPS 16

typedef struct {
    int8_t codes[BLOCK_MAX_VALUES];
    float step[BLOCK_MAX_GROUPS];
    float offset[BLOCK_MAX_GROUPS];
} unpacked_block;

/* Fills `u` from `block`; returns the codes (u->codes, or the block's own int8 codes). */
typedef const int8_t *(*block_unpacker)(const uint8_t *block, unpacked_block *u);

typedef struct {
    int64_t values, bytes, group;
    block_unpacker unpack;
    /* w = step * q with no offset and the product exact in fp32 (fp16 d times a scale of at
     * most 6 bits, times a code of at most 8 bits: Q8_0, Q4_0, Q5_0, Q3_K): the product alone
     * is the weight (no subtraction of a zero offset). */
    int exact_product;
} block_format;

/* Unpacking runs 16 bytes at a time in SSE registers (SSSE3: both ISAs of vec16.h have it). */

/* 16 bytes: low nibbles -> low[0..15], high nibbles -> high[0..15], each minus `bias`. */
static inline void nibbles16(const uint8_t *qs, int bias, int8_t *low, int8_t *high) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0f), offset = _mm_set1_epi8((char)bias);
    _mm_storeu_si128((__m128i *)low, _mm_sub_epi8(_mm_and_si128(bytes, mask), offset));
    _mm_storeu_si128((__m128i *)high,
                     _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), offset));
}

/* Byte i = 0x10 where bit i of `bits` is set, else 0 (i = 0..15). */
static inline __m128i bits_as_fifth16(uint32_t bits) {
    const __m128i spread = _mm_shuffle_epi8(
        _mm_set1_epi16((short)bits), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i select = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select),
                         _mm_set1_epi8(0x10));
}

/* Byte i = 0x10 where bit `bit` of bytes[i] is set, else 0 (16 bytes). */
static inline __m128i bit_as_fifth16(const uint8_t *bytes, int bit) {
    const __m128i select = _mm_set1_epi8((char)(1 << bit));
    const __m128i set = _mm_cmpeq_epi8(
        _mm_and_si128(_mm_loadu_si128((const __m128i *)bytes), select), select);
    return _mm_and_si128(set, _mm_set1_epi8(0x10));
}

/* 16 bytes of nibbles plus 32 fifth bits (bit i of `high` for value i): values 0-15 from the
 * low nibbles, 16-31 from the high ones, minus `bias`. */
static inline void fives32(const uint8_t *qs, uint32_t high, int bias, int8_t *codes) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0f), offset = _mm_set1_epi8((char)bias);
    const __m128i low = _mm_or_si128(_mm_and_si128(bytes, mask), bits_as_fifth16(high));
    const __m128i upper = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                                       bits_as_fifth16(high >> 16));
    _mm_storeu_si128((__m128i *)codes, _mm_sub_epi8(low, offset));
    _mm_storeu_si128((__m128i *)(codes + 16), _mm_sub_epi8(upper, offset));
}

static inline void unpack_nibbles16(const uint8_t *qs, int bias, int8_t *codes) {
    nibbles16(qs, bias, codes, codes + 16);
}

static inline void unpack_fives(const uint8_t *qs, uint32_t high, int bias, int8_t *codes) {
    fives32(qs, high, bias, codes);
}

static inline const int8_t *unpack_q8_0(const uint8_t *block, unpacked_block *u) {
    u->step[0] = half_at(block);
    u->offset[0] = 0.0f;
    return (const int8_t *)(block + 2);
}

static inline const int8_t *unpack_q4_0(const uint8_t *block, unpacked_block *u) {
    u->step[0] = half_at(block);
    u->offset[0] = 0.0f;
    unpack_nibbles16(block + 2, 8, u->codes);
    return u->codes;
}

static inline const int8_t *unpack_q4_1(const uint8_t *block, unpacked_block *u) {
    u->step[0] = half_at(block);
    u->offset[0] = -half_at(block + 2); /* d * q + m */
    unpack_nibbles16(block + 4, 0, u->codes);
    return u->codes;
}

static inline const int8_t *unpack_q5_0(const uint8_t *block, unpacked_block *u) {
    uint32_t high;
    memcpy(&high, block + 2, sizeof high);
    u->step[0] = half_at(block);
    u->offset[0] = 0.0f;
    unpack_fives(block + 6, high, 16, u->codes);
    return u->codes;
}

static inline const int8_t *unpack_q5_1(const uint8_t *block, unpacked_block *u) {
    uint32_t high;
    memcpy(&high, block + 4, sizeof high);
    u->step[0] = half_at(block);
    u->offset[0] = -half_at(block + 2);
    unpack_fives(block + 8, high, 0, u->codes);
    return u->codes;
}

/* Q2_K (84 bytes): 16 bytes of (4-bit scale, 4-bit min), 64 of 2-bit codes (each 32 bytes:
 * four shifts of 32 values), fp16 d, dmin. Groups of 16: (d * scale) * q - dmin * min. */
static inline const int8_t *unpack_q2_k(const uint8_t *block, unpacked_block *u) {
    const float d = half_at(block + 80), dmin = half_at(block + 82);
    for (int g = 0; g < 16; ++g) {
        u->step[g] = d * (float)(block[g] & 0x0f);
        u->offset[g] = dmin * (float)(block[g] >> 4);
    }
    const uint8_t *qs = block + 16;
    for (int half = 0; half < 2; ++half) {
        for (int shift = 0; shift < 4; ++shift) {
            for (int i = 0; i < 32; ++i) {
                u->codes[128 * half + 32 * shift + i] = (int8_t)((qs[32 * half + i] >> (2 * shift)) & 3);
            }
        }
    }
    return u->codes;
}

/* Q3_K (110 bytes): 32 bytes of high-bit masks, 64 of 2-bit codes, 12 of 6-bit scales, fp16 d.
 * Groups of 16: (d * (scale - 32)) * (low - 4 * !high). */
static inline const int8_t *unpack_q3_k(const uint8_t *block, unpacked_block *u) {
    const uint8_t *hmask = block, *qs = block + 32, *packed = block + 96;
    const float d = half_at(block + 108);
    for (int g = 0; g < 16; ++g) {
        const int low = (packed[g % 8] >> (4 * (g / 8))) & 0x0f;
        const int high = (packed[8 + g % 4] >> (2 * (g / 4))) & 0x03;
        u->step[g] = d * (float)((low | (high << 4)) - 32);
        u->offset[g] = 0.0f;
    }
    for (int half = 0; half < 2; ++half) {
        for (int shift = 0; shift < 4; ++shift) {
            const int index = 4 * half + shift; /* which of hmask's 8 bits */
            for (int i = 0; i < 32; ++i) {
                const int low = (qs[32 * half + i] >> (2 * shift)) & 3;
                const int missing = ((hmask[i] >> index) & 1) ^ 1;
                u->codes[32 * index + i] = (int8_t)(low - 4 * missing);
            }
        }
    }
    return u->codes;
}

/* k_steps in vector registers: Q4_K / Q5_K's eight steps d * scale into `step`, the eight
 * offsets dmin * min returned (exact products: fp16 times 6 bits). The 12 bytes of 6-bit
 * (scale, min) pairs are read as three little-endian words, a byte per pair in each lane. */
static inline __m256 k_steps8(const uint8_t *block, __m256 *step) {
    uint32_t packed[3];
    memcpy(packed, block + 4, sizeof packed);
    const uint32_t six = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    const uint32_t scales_low = packed[0] & six, mins_low = packed[1] & six;
    const uint32_t scales_high = (packed[2] & low4) | (((packed[0] >> 6) & top2) << 4);
    const uint32_t mins_high = ((packed[2] >> 4) & low4) | (((packed[1] >> 6) & top2) << 4);
    const __m128i bytes = _mm_setr_epi32((int)scales_low, (int)scales_high, (int)mins_low,
                                         (int)mins_high);
    const __m256 scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
    *step = _mm256_mul_ps(scales, _mm256_set1_ps(half_at(block)));
    return _mm256_mul_ps(mins, _mm256_set1_ps(half_at(block + 2)));
}

/* Q4_K / Q5_K's eight 6-bit (scale, min) pairs -> steps and offsets of groups of 32. */
static void k_steps(const uint8_t *block, unpacked_block *u) {
    __m256 step;
    _mm256_storeu_ps(u->offset, k_steps8(block, &step));
    _mm256_storeu_ps(u->step, step);
}

static inline const int8_t *unpack_q4_k(const uint8_t *block, unpacked_block *u) {
    k_steps(block, u);
    const uint8_t *qs = block + 16;
    for (int pair = 0; pair < 4; ++pair) {
        for (int half = 0; half < 2; ++half) {
            nibbles16(qs + 32 * pair + 16 * half, 0, u->codes + 64 * pair + 16 * half,
                      u->codes + 64 * pair + 32 + 16 * half);
        }
    }
    return u->codes;
}

static inline const int8_t *unpack_q5_k(const uint8_t *block, unpacked_block *u) {
    k_steps(block, u);
    const uint8_t *qh = block + 16, *qs = block + 48;
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int pair = 0; pair < 4; ++pair) {
        for (int half = 0; half < 2; ++half) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(qs + 32 * pair + 16 * half));
            const __m128i low = _mm_or_si128(_mm_and_si128(bytes, mask),
                                             bit_as_fifth16(qh + 16 * half, 2 * pair));
            const __m128i high = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                                              bit_as_fifth16(qh + 16 * half, 2 * pair + 1));
            _mm_storeu_si128((__m128i *)(u->codes + 64 * pair + 16 * half), low);
            _mm_storeu_si128((__m128i *)(u->codes + 64 * pair + 32 + 16 * half), high);
        }
    }
    return u->codes;
}

/* Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16
 * values), fp16 d: (d * scale) * (q - 32), in llama.cpp's interleaving. */
static inline const int8_t *unpack_q6_k(const uint8_t *block, unpacked_block *u) {
    const uint8_t *ql = block, *qh = block + 128;
    const int8_t *scales = (const int8_t *)(block + 192);
    const float d = half_at(block + 208);
    for (int g = 0; g < 16; ++g) {
        u->step[g] = d * (float)scales[g];
        u->offset[g] = 0.0f;
    }
    const __m128i nibble = _mm_set1_epi8(0x0f), two = _mm_set1_epi8(0x03);
    const __m128i bias = _mm_set1_epi8(32);
    for (int half = 0; half < 2; ++half) {
        for (int group = 0; group < 4; ++group) { /* 32 values each */
            const uint8_t *low = ql + 64 * half + 32 * (group % 2);
            const int low_shift = 4 * (group / 2), high_shift = 2 * group;
            for (int part = 0; part < 2; ++part) {
                const __m128i l = _mm_and_si128(
                    _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(low + 16 * part)), low_shift),
                    nibble);
                const __m128i h = _mm_and_si128(
                    _mm_srli_epi16(
                        _mm_loadu_si128((const __m128i *)(qh + 32 * half + 16 * part)), high_shift),
                    two);
                const __m128i q = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(h, 4)), bias);
                _mm_storeu_si128((__m128i *)(u->codes + 128 * half + 32 * group + 16 * part), q);
            }
        }
    }
    return u->codes;
}

/* The format of GGML type `type`; 0 when handled here, -1 otherwise. */
static int block_format_of(int type, block_format *f) {
    switch (type) {
    case GGML_Q4_0: *f = (block_format){32, 18, 32, unpack_q4_0, 1}; return 0;
    case GGML_Q4_1: *f = (block_format){32, 20, 32, unpack_q4_1, 0}; return 0;
    case GGML_Q5_0: *f = (block_format){32, 22, 32, unpack_q5_0, 1}; return 0;
    case GGML_Q5_1: *f = (block_format){32, 24, 32, unpack_q5_1, 0}; return 0;
    case GGML_Q8_0: *f = (block_format){32, 34, 32, unpack_q8_0, 1}; return 0;
    case GGML_Q2_K: *f = (block_format){256, 84, 16, unpack_q2_k, 0}; return 0;
    case GGML_Q3_K: *f = (block_format){256, 110, 16, unpack_q3_k, 1}; return 0;
    case GGML_Q4_K: *f = (block_format){256, 144, 32, unpack_q4_k, 0}; return 0;
    case GGML_Q5_K: *f = (block_format){256, 176, 32, unpack_q5_k, 0}; return 0;
    case GGML_Q6_K: *f = (block_format){256, 210, 16, unpack_q6_k, 0}; return 0;
    default: return -1;
    }
}

/* The 16 weights at value j of an unpacked block (groups of `group` values). */
static inline vec16 block_weights(const int8_t *codes, const unpacked_block *u, int64_t group,
                                  int64_t j) {
    const vec16 q = vec16_load_i8(codes + j, 16);
    const int64_t g = j / group;
    return vec16_sub(vec16_mul(q, vec16_set1(u->step[g])), vec16_set1(u->offset[g]));
}

/* block_weights without the offset where the format has none. */
static inline __attribute__((always_inline)) vec16 format_weights(const block_format f,
                                                                  const int8_t *codes,
                                                                  const unpacked_block *u,
                                                                  int64_t j) {
    if (f.exact_product) {
        return vec16_mul(vec16_load_i8(codes + j, 16), vec16_set1(u->step[j / f.group]));
    }
    return block_weights(codes, u, f.group, j);
}

/* n_blocks blocks of `type` -> fp32 values in order. Returns -1 for a type not handled here. */
int hearth_blocks_to_f32(int type, const uint8_t *blocks, int64_t n_blocks, float *out,
                         int threads) {
    block_format f;
    if (block_format_of(type, &f) != 0) {
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
        unpacked_block u;
        const int8_t *codes = f.unpack(blocks + b * f.bytes, &u);
        for (int64_t j = 0; j < f.values; j += 16) {
            vec16_store_f32(out + b * f.values + j, block_weights(codes, &u, f.group, j), 16);
        }
    }
    return 0;
}

/* A block's contribution to one input row's dot product, computed from its bytes in registers
 * (no int8 buffer): where the unpacking, not the memory, bounds the GEMV. AVX-512 only (its
 * 32-bit lanes and mask registers unpack 16 codes in two instructions); NULL elsewhere, and
 * the unpacked-buffer path runs. Same sums as that path's exact-product form. */
typedef void (*block_dot_fn)(const uint8_t *block, const float *x, vec16 *even, vec16 *odd);
#if VEC16_REGISTERS >= 32
/* Q4_0 / Q5_0: sum x * (d * q) over the 32 values, q = nibble (| fifth bit) - bias, values
 * 0-15 into the even sums and 16-31 into the odd ones. */
static inline __attribute__((always_inline)) void nibble_block_dot(
    const uint8_t *qs, uint32_t high, int fives, float d, const float *x, vec16 *even,
    vec16 *odd) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    const __m512i nibble = _mm512_set1_epi32(0x0f);
    __m512i low = _mm512_and_si512(bytes, nibble), upper = _mm512_srli_epi32(bytes, 4);
    if (fives) { /* q = nibble - 16 where the fifth bit is clear, else the nibble */
        const __m512i sixteen = _mm512_set1_epi32(16);
        low = _mm512_mask_sub_epi32(low, (__mmask16)~high, low, sixteen);
        upper = _mm512_mask_sub_epi32(upper, (__mmask16)~(high >> 16), upper, sixteen);
    } else {
        const __m512i eight = _mm512_set1_epi32(8);
        low = _mm512_sub_epi32(low, eight);
        upper = _mm512_sub_epi32(upper, eight);
    }
    const __m512 step = _mm512_set1_ps(d); /* step * q is exact: the weights themselves */
    *even = _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_mul_ps(_mm512_cvtepi32_ps(low), step), *even);
    *odd = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), _mm512_mul_ps(_mm512_cvtepi32_ps(upper), step),
                           *odd);
}
static void dot_q4_0(const uint8_t *block, const float *x, vec16 *even, vec16 *odd) {
    nibble_block_dot(block + 2, 0, 0, half_at(block), x, even, odd);
}
static void dot_q5_0(const uint8_t *block, const float *x, vec16 *even, vec16 *odd) {
    uint32_t high;
    memcpy(&high, block + 2, sizeof high);
    nibble_block_dot(block + 6, high, 1, half_at(block), x, even, odd);
}
/* Q4_K: w = fl(fl(step * q) - offset) per group of 32, 16 nibbles a step. */
static void dot_q4_k(const uint8_t *block, const float *x, vec16 *even, vec16 *odd) {
    unpacked_block u;
    k_steps(block, &u);
    const uint8_t *qs = block + 16;
    const __m512i nibble = _mm512_set1_epi32(0x0f);
    for (int pair = 0; pair < 4; ++pair) {
        const __m512 low_step = _mm512_set1_ps(u.step[2 * pair]);
        const __m512 low_offset = _mm512_set1_ps(u.offset[2 * pair]);
        const __m512 high_step = _mm512_set1_ps(u.step[2 * pair + 1]);
        const __m512 high_offset = _mm512_set1_ps(u.offset[2 * pair + 1]);
        for (int half = 0; half < 2; ++half) {
            const __m512i bytes = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(qs + 32 * pair + 16 * half)));
            const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble));
            const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
            const __m512 low_w = _mm512_sub_ps(_mm512_mul_ps(low, low_step), low_offset);
            const __m512 high_w = _mm512_sub_ps(_mm512_mul_ps(high, high_step), high_offset);
            /* Values 16c..16c+15 (chunk c) go to the even sums for even c, as in the unpacked
             * path: chunks 4 pair + half (low) and 4 pair + 2 + half (high), in that order. */
            vec16 *sums = half == 0 ? even : odd;
            *sums = _mm512_fmadd_ps(_mm512_loadu_ps(x + 64 * pair + 16 * half), low_w, *sums);
            *sums = _mm512_fmadd_ps(_mm512_loadu_ps(x + 64 * pair + 32 + 16 * half), high_w, *sums);
        }
    }
}
/* Q6_K: w = fl(step * (q6 - 32)) per group of 16 (step = d * scale), formed as one FMA
 * q6 * step + (-32 * step): the exact value rounded once, as the unpacked path's product, with
 * -32 * step exact. The steps are made in one vector op and read back as broadcasts from
 * memory (loads, not ALU ops); the top two bits of each code are shifted into place with
 * nothing above them, so one ternary-logic op merges them with the nibble. The sums are in the
 * unpacked path's order (chunk c of 16 values into the even sums for even c). */
static void dot_q6_k(const uint8_t *block, const float *x, vec16 *even, vec16 *odd) {
    const uint8_t *ql = block, *qh = block + 128;
    float steps[16], offsets[16];
    const __m512 step_vector = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))),
        _mm512_set1_ps(half_at(block + 208)));
    _mm512_storeu_ps(steps, step_vector);
    _mm512_storeu_ps(offsets, _mm512_mul_ps(step_vector, _mm512_set1_ps(-32.0f)));
    const __m512i nibble = _mm512_set1_epi32(0x0f);
    for (int half = 0; half < 2; ++half) {
        for (int part = 0; part < 2; ++part) { /* 16 values of each 32 */
            vec16 *sums = part == 0 ? even : odd;
            const __m512i high = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(qh + 32 * half + 16 * part)));
            const __m512i low_bytes[2] = {
                _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(ql + 64 * half + 16 * part))),
                _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(ql + 64 * half + 32 + 16 * part))),
            };
            for (int group = 0; group < 4; ++group) { /* 32 values each, as unpack_q6_k's */
                const __m512i low = _mm512_srli_epi32(low_bytes[group % 2], 4 * (group / 2));
                /* bits 2 group, 2 group + 1 of the byte to bits 4, 5; bits 0-3 hold lower
                 * pairs, nothing lies above */
                const __m512i top = _mm512_srli_epi32(_mm512_slli_epi32(high, 30 - 2 * group), 26);
                /* (low & 0x0f) | (top & ~0x0f) */
                const __m512i q = _mm512_ternarylogic_epi32(low, top, nibble, 0xe4);
                const int chunk = 8 * half + 2 * group + part;
                const __m512 weights = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(q), _mm512_set1_ps(steps[chunk]), _mm512_set1_ps(offsets[chunk]));
                *sums = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16 * chunk), weights, *sums);
            }
        }
    }
}
#define DIRECT_DOT_Q4_0 dot_q4_0
#define DIRECT_DOT_Q5_0 dot_q5_0
#define DIRECT_DOT_Q4_K dot_q4_k
#define DIRECT_DOT_Q6_K dot_q6_k
#else
#define DIRECT_DOT_Q4_0 NULL
#define DIRECT_DOT_Q5_0 NULL
#define DIRECT_DOT_Q4_K NULL
#define DIRECT_DOT_Q6_K NULL
#endif

/* Input rows computed together, each weight block unpacked once for them: their even and odd
 * sums take 16 of AVX-512's 32 registers. AVX2's 16 registers hold only 2 rows' (two per
 * vec16), but unpacking the blocks once for 8 rows and spilling sums to L1 measured faster at
 * 8 rows than 2 or 4 rows at a time (Q5_0 2.8 G weights/s against 1.5 and 2.4, one thread,
 * the -march=haswell build on the Xeon), and no slower at 4 rows. */
#define BLOCK_INPUT_ROWS 8

/* y[i * ldy + r] for `mr` input rows (a constant at each inlined call: the sums then live in
 * registers) and one weight row `row` of format `f`, each block unpacked once for all of
 * them. Every input row's sums are formed in the order of the one-row path of
 * blocks_gemv_rows (chunk c of 16 values into the even sums for even c), so a row's result
 * does not depend on the rows computed beside it. */
static inline __attribute__((always_inline)) void block_row_inputs(
    const block_format f, const float *x, const int mr, int64_t k, const uint8_t *row,
    float *y, int64_t ldy) {
    const int64_t blocks_per_row = k / f.values;
    unpacked_block u;
    vec16 even[BLOCK_INPUT_ROWS], odd[BLOCK_INPUT_ROWS];
    for (int i = 0; i < mr; ++i) {
        even[i] = vec16_zero();
        odd[i] = vec16_zero();
    }
    for (int64_t b = 0; b < blocks_per_row; ++b) {
        _mm_prefetch((const char *)row + b * f.bytes + PREFETCH_BYTES, _MM_HINT_T0);
        const int8_t *codes = f.unpack(row + b * f.bytes, &u);
        const float *xb = x + b * f.values;
        for (int64_t j = 0; j < f.values; j += 32) {
            const vec16 low = format_weights(f, codes, &u, j);
            const vec16 high = format_weights(f, codes, &u, j + 16);
            for (int i = 0; i < mr; ++i) {
                even[i] = vec16_fmadd(vec16_load_f32(xb + i * k + j, 16), low, even[i]);
                odd[i] = vec16_fmadd(vec16_load_f32(xb + i * k + j + 16, 16), high, odd[i]);
            }
        }
    }
    for (int i = 0; i < mr; ++i) {
        y[i * ldy] = vec16_sum(vec16_add(even[i], odd[i]));
    }
}

/* y[i * ldy + r] = sum_k x[i, k] * w[r, k] for input rows i < m (fp32, [m, k] contiguous) and
 * weight rows first <= r < last of format `f` (each row k / values whole blocks, rows
 * contiguous): fp32 products and sums, 16 lanes, two accumulators per input row. Inlined
 * into one function per type (below) with `f` a constant, so that the unpacking and the group
 * arithmetic are compiled for it (an OpenMP region would pass `f` as data: no inlining).
 * Several input rows go BLOCK_INPUT_ROWS at a time through block_row_inputs, in the same order
 * of sums as one row: a row's result is the same alone or beside others. */
static inline __attribute__((always_inline)) void blocks_gemv_rows(
    const block_format f, const block_dot_fn direct, const float *x, int64_t m, int64_t k,
    const uint8_t *w, int64_t first, int64_t last, float *y, int64_t ldy) {
    const int64_t blocks_per_row = k / f.values, row_bytes = blocks_per_row * f.bytes;
    unpacked_block u;
    for (int64_t r = first; r < last; ++r) {
        const uint8_t *row = w + r * row_bytes;
        if (m == 1) {
            vec16 even = vec16_zero(), odd = vec16_zero();
            for (int64_t b = 0; b < blocks_per_row; ++b) {
                _mm_prefetch((const char *)row + b * f.bytes + PREFETCH_BYTES, _MM_HINT_T0);
                const float *xb = x + b * f.values;
                if (direct != NULL) {
                    direct(row + b * f.bytes, xb, &even, &odd);
                    continue;
                }
                const int8_t *codes = f.unpack(row + b * f.bytes, &u);
                for (int64_t j = 0; j < f.values; j += 32) {
                    even = vec16_fmadd(vec16_load_f32(xb + j, 16),
                                       format_weights(f, codes, &u, j), even);
                    odd = vec16_fmadd(vec16_load_f32(xb + j + 16, 16),
                                      format_weights(f, codes, &u, j + 16), odd);
                }
            }
            y[r] = vec16_sum(vec16_add(even, odd));
            continue;
        }
        for (int64_t i0 = 0; i0 < m; i0 += BLOCK_INPUT_ROWS) {
            const int64_t rows = m - i0 < BLOCK_INPUT_ROWS ? m - i0 : BLOCK_INPUT_ROWS;
            const float *xi = x + i0 * k;
            float *yi = y + i0 * ldy + r;
            switch (rows) { /* a constant count in each copy */
            case 8: block_row_inputs(f, xi, 8, k, row, yi, ldy); break;
            case 7: block_row_inputs(f, xi, 7, k, row, yi, ldy); break;
            case 6: block_row_inputs(f, xi, 6, k, row, yi, ldy); break;
            case 5: block_row_inputs(f, xi, 5, k, row, yi, ldy); break;
            case 4: block_row_inputs(f, xi, 4, k, row, yi, ldy); break;
            case 3: block_row_inputs(f, xi, 3, k, row, yi, ldy); break;
            case 2: block_row_inputs(f, xi, 2, k, row, yi, ldy); break;
            default: block_row_inputs(f, xi, 1, k, row, yi, ldy); break;
            }
        }
    }
}

typedef void (*gemv_rows_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t,
                             float *, int64_t);
#define BLOCK_GEMV(NAME, VALUES, BYTES, GROUP, EXACT, DIRECT)                                   \
    static void gemv_##NAME(const float *x, int64_t m, int64_t k, const uint8_t *w,             \
                            int64_t first, int64_t last, float *y, int64_t ldy) {              \
        const block_format f = {VALUES, BYTES, GROUP, unpack_##NAME, EXACT};                   \
        blocks_gemv_rows(f, DIRECT, x, m, k, w, first, last, y, ldy);                          \
    }
BLOCK_GEMV(q4_0, 32, 18, 32, 1, DIRECT_DOT_Q4_0)
BLOCK_GEMV(q4_1, 32, 20, 32, 0, NULL)
BLOCK_GEMV(q5_0, 32, 22, 32, 1, DIRECT_DOT_Q5_0)
BLOCK_GEMV(q5_1, 32, 24, 32, 0, NULL)
BLOCK_GEMV(q8_0, 32, 34, 32, 1, NULL)
BLOCK_GEMV(q2_k, 256, 84, 16, 0, NULL)
BLOCK_GEMV(q3_k, 256, 110, 16, 1, NULL)
BLOCK_GEMV(q4_k, 256, 144, 32, 0, DIRECT_DOT_Q4_K)
BLOCK_GEMV(q5_k, 256, 176, 32, 0, NULL)
BLOCK_GEMV(q6_k, 256, 210, 16, 0, DIRECT_DOT_Q6_K)

/* Weight rows per unit of a thread's work: whole cache lines of output, enough rows to
 * amortise the call. */
#define GEMV_ROWS_PER_UNIT 16

/* The GEMV above for GGML type `type` (format `f`), NULL for a type not handled here or a row
 * length `k` not whole blocks of it. */
static gemv_rows_fn gemv_of(int type, int64_t k, block_format *f) {
    if (block_format_of(type, f) != 0 || k % f->values != 0) {
        return NULL;
    }
    switch (type) {
    case GGML_Q4_0: return gemv_q4_0;
    case GGML_Q4_1: return gemv_q4_1;
    case GGML_Q5_0: return gemv_q5_0;
    case GGML_Q5_1: return gemv_q5_1;
    case GGML_Q8_0: return gemv_q8_0;
    case GGML_Q2_K: return gemv_q2_k;
    case GGML_Q3_K: return gemv_q3_k;
    case GGML_Q4_K: return gemv_q4_k;
    case GGML_Q5_K: return gemv_q5_k;
    default: return gemv_q6_k;
    }
}

/* The GEMV above for GGML type `type` over all n weight rows, split among `threads`. Returns -1
 * for a type not handled here or m outside 1..MAX_INPUT_ROWS. */
int hearth_blocks_gemv(int type, const float *x, int64_t m, int64_t k, const uint8_t *w,
                       int64_t n, float *y, int64_t ldy, int threads) {
    block_format f;
    const gemv_rows_fn rows = gemv_of(type, k, &f);
    if (rows == NULL || m < 1 || m > MAX_INPUT_ROWS) {
        return -1;
    }
    const int64_t units = (n + GEMV_ROWS_PER_UNIT - 1) / GEMV_ROWS_PER_UNIT;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t unit = 0; unit < units; ++unit) {
        const int64_t first = unit * GEMV_ROWS_PER_UNIT;
        const int64_t last = first + GEMV_ROWS_PER_UNIT < n ? first + GEMV_ROWS_PER_UNIT : n;
        rows(x, m, k, w, first, last, y, ldy);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * The block GEMV on AVX512-BF16 (vdpbf16ps: 32 bf16 products summed into 16 fp32 lanes per
 * instruction), the weights still exact. A block's weights are step * q - offset per group
 * (step, offset exact fp32, q a small integer), so
 *     sum_i w_i x_i = sum_groups step * (sum_i q_i x_i) - offset * (sum_i x_i):
 * the codes q are exact in bf16 (|q| <= 128), the inner sums run on them, and the group scales
 * apply in fp32 after. The one rounding added is x -> bf16 (round to nearest even, as torch
 * rounds; the instructions flush bf16 subnormals, |x| < 1.2e-38, to zero). Products of two
 * bf16 are exact in fp32; each dot product of 32 starts from zero (or chains two chunks of
 * the same steps), is scaled by its lanes' steps and added to one of the row's four fp32 sums
 * (one FMA), and the offsets' sums (K-types with mins) are formed on the side from the fp32
 * sums of each 32 (or 16) inputs. Q4_K and Q6_K take their codes as the bf16 of 128 + q (an
 * OR into the exponent, no table), reading inputs stored in the order that makes that cheap;
 * the 128 x is taken back with the offsets. Compiled where the compiler targets AVX512-BF16
 * (-march=native on such a CPU); elsewhere none of it exists and hearth_blocks_gemv_bf16
 * refuses every type (the plan then names none).
 */
#if defined(__AVX512BF16__) && VEC16_REGISTERS >= 32
#define HAS_BF16_GEMV 1

/* Input rows computed together, each block's codes converted once for them, and the sums each
 * keeps: chunk c of a row goes to its sums c % BF16_SUMS (independent FMA chains; one chain
 * would wait on each FMA's latency). 4 x 4 of the 32 registers. */
#define BF16_INPUT_ROWS 4
#define BF16_SUMS 4

/* The constants the conversions of codes to bf16 read (built once per call of a row range). */
typedef struct {
    __m512i signed8;   /* bf16 of i - 8, i = 0..31 (Q4_0's codes) */
    __m512i signed16;  /* bf16 of i - 16 (Q5_0's) */
} bf16_codes;

/* bf16 of first + i for i = 0..31, exactly (all small integers). */
static inline __m512i bf16_integers(int first) {
    const __m512 ramp = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 low = _mm512_add_ps(ramp, _mm512_set1_ps((float)first));
    const __m512 high = _mm512_add_ps(ramp, _mm512_set1_ps((float)(first + 16)));
    return (__m512i)_mm512_cvtne2ps_pbh(high, low);
}

static inline bf16_codes bf16_code_tables(void) {
    return (bf16_codes){bf16_integers(-8), bf16_integers(-16)};
}

/* 16 bytes -> 32 words: the low nibbles (values 0-15), then the high ones (16-31). */
static inline __m512i nibble_words16(const uint8_t *qs) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    const __m256i nibble = _mm256_set1_epi16(0x0f);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nibble)),
                              _mm256_srli_epi16(bytes, 4), 1);
}

/* The dot product of 32 bf16 codes with 32 bf16 inputs at x, into 16 fp32 lanes (lane i: values
 * 2i and 2i + 1), from zero. */
static inline __m512 dot32(__m512i codes, const uint16_t *x) {
    return _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)codes,
                            (__m512bh)_mm512_loadu_si512((const void *)x));
}

/* Row i's sums `slot` += step * (codes . x_i) for `mr` input rows x_i = x + i * k. */
static inline __attribute__((always_inline)) void add_chunk(__m512 *sums, const int mr,
                                                            const int slot, __m512i codes,
                                                            __m512 step, const uint16_t *x,
                                                            int64_t k) {
    for (int i = 0; i < mr; ++i) {
        __m512 *into = &sums[i * BF16_SUMS + slot];
        *into = _mm512_fmadd_ps(dot32(codes, x + i * k), step, *into);
    }
}

/* Row i's sums `slot` and `slot` + 1 += low_step * (a.x_i[0:32] + c.x_i[32:64]) and
 * high_step * (b.x_i[64:96] + d.x_i[96:128]) for `mr` input rows x_i = x + i * k: 128 values. */
static inline __attribute__((always_inline)) void add_chunk_pair(
    __m512 *sums, const int mr, const int slot, __m512i a, __m512i b, __m512i c, __m512i d,
    __m512 low_step, __m512 high_step, const uint16_t *x, int64_t k) {
    for (int i = 0; i < mr; ++i) {
        const uint16_t *xi = x + i * k;
        const __m512 low = _mm512_dpbf16_ps(dot32(a, xi), (__m512bh)c,
                                            (__m512bh)_mm512_loadu_si512(xi + 32));
        const __m512 high = _mm512_dpbf16_ps(dot32(b, xi + 64), (__m512bh)d,
                                             (__m512bh)_mm512_loadu_si512(xi + 96));
        __m512 *own = &sums[i * BF16_SUMS + slot];
        own[0] = _mm512_fmadd_ps(low, low_step, own[0]);
        own[1] = _mm512_fmadd_ps(high, high_step, own[1]);
    }
}

/* One block's contribution to `mr` input rows (x: the block's first input of row 0; chunk_sums:
 * its first 32-input sum of row 0, rows k / 32 apart). Q8_0, Q4_0, Q5_0 (one chunk, into the
 * sums `slot`): d * q; Q4_K: (d * scale) * q - dmin * min per 32 values; Q6_K: (d * scale) *
 * (q - 32) per 16 (chunk c into the sums c % BF16_SUMS). */

/* Q6_K's bf16 code words from 16-bit lanes whose bits 0-3 hold the low nibble (`nibbles`) and
 * bits 4-5 the two high bits (`high`): (nibbles & 0xf) | (high & 0x30) | 0x4300, in two
 * ternary-logic ops (0xEA: (a & b) | c). */
static inline __m512i q6_code_words(__m512i nibbles, __m512i high) {
    const __m512i with_high = _mm512_ternarylogic_epi32(high, _mm512_set1_epi16(0x0030),
                                                        _mm512_set1_epi16(0x4300), 0xEA);
    return _mm512_ternarylogic_epi32(nibbles, _mm512_set1_epi16(0x000f), with_high, 0xEA);
}

static inline __attribute__((always_inline)) void bf16_block(
    const int type, const bf16_codes *t, const uint8_t *block, const int mr, const int slot,
    const uint16_t *x, const float *chunk_sums, const float *group_sums, int64_t k,
    __m512 *sums, __m256 *offsets, __m256 *excess, __m512 *excess16) {
    switch (type) {
    case GGML_Q8_0: {
        const __m128i *q = (const __m128i *)(block + 2);
        const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
        const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
        add_chunk(sums, mr, slot, (__m512i)_mm512_cvtne2ps_pbh(high, low),
                  _mm512_set1_ps(half_at(block)), x, k);
        break;
    }
    case GGML_Q4_0:
        add_chunk(sums, mr, slot,
                  _mm512_permutexvar_epi16(nibble_words16(block + 2), t->signed8),
                  _mm512_set1_ps(half_at(block)), x, k);
        break;
    case GGML_Q5_0: {
        uint32_t high;
        memcpy(&high, block + 2, sizeof high);
        const __m512i low = nibble_words16(block + 6);
        /* Value i's fifth bit is bit i of `high`: 16 more where it is set. */
        const __m512i fifth = _mm512_mask_add_epi16(low, (__mmask32)high, low,
                                                   _mm512_set1_epi16(16));
        add_chunk(sums, mr, slot, _mm512_permutexvar_epi16(fifth, t->signed16),
                  _mm512_set1_ps(half_at(block)), x, k);
        break;
    }
    case GGML_Q4_K: {
        /* 64 bytes of nibbles at a time as 32 words: each word's four nibbles | 0x4300 are the
         * bf16 of 128 + q, exactly, in four vectors with no lane crossing (x is in
         * Q4K_INPUT_ORDER to match); words' low bytes (A: low nibbles, B: high) and high bytes
         * (C, D) hold chunks 4L and 4L + 2 (A, C) or 4L + 1 and 4L + 3 (B, D) in lanes 0-7 and
         * 8-15 of a dot product. The 128 x is taken back with the offsets (`excess`). */
        __m256 step8;
        const __m256 offset = k_steps8(block, &step8);
        const __m512 steps = _mm512_castps256_ps512(step8);
        const uint8_t *qs = block + 16;
        const __m512i nibble = _mm512_set1_epi16(0x000f), exponent = _mm512_set1_epi16(0x4300);
        for (int L = 0; L < 2; ++L) {
            const __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * L));
            /* (raw & nibble) | exponent in one instruction (truth table 0xEA). */
            const __m512i a = _mm512_ternarylogic_epi32(raw, nibble, exponent, 0xEA);
            const __m512i b = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), nibble,
                                                        exponent, 0xEA);
            const __m512i c = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 8), nibble,
                                                        exponent, 0xEA);
            const __m512i d = _mm512_or_si512(_mm512_srli_epi16(raw, 12), exponent);
            const __m512 low_step = _mm512_permutexvar_ps(
                _mm512_setr_epi32(4 * L, 4 * L, 4 * L, 4 * L, 4 * L, 4 * L, 4 * L, 4 * L,
                                  4 * L + 2, 4 * L + 2, 4 * L + 2, 4 * L + 2, 4 * L + 2,
                                  4 * L + 2, 4 * L + 2, 4 * L + 2),
                steps);
            const __m512 high_step = _mm512_permutexvar_ps(
                _mm512_setr_epi32(4 * L + 1, 4 * L + 1, 4 * L + 1, 4 * L + 1, 4 * L + 1,
                                  4 * L + 1, 4 * L + 1, 4 * L + 1, 4 * L + 3, 4 * L + 3,
                                  4 * L + 3, 4 * L + 3, 4 * L + 3, 4 * L + 3, 4 * L + 3,
                                  4 * L + 3),
                steps);
            add_chunk_pair(sums, mr, 2 * L, a, b, c, d, low_step, high_step, x + 128 * L, k);
        }
        for (int i = 0; i < mr; ++i) {
            const __m256 chunk = _mm256_loadu_ps(chunk_sums + i * (k / 32));
            offsets[i] = _mm256_fmadd_ps(offset, chunk, offsets[i]);
            excess[i] = _mm256_fmadd_ps(step8, chunk, excess[i]);
        }
        break;
    }
    default: { /* GGML_Q6_K */
        /* As Q4_K's: 64 bytes of low nibbles (a half's) as 32 words and the half's 32 bytes of
         * high bits in both 256-bit lanes (word w's are the bytes of word w % 16); each word
         * yields four 6-bit codes q6 = nibble | 2 bits << 4, made the bf16 of 128 + q6 exactly
         * with no lane crossing (x in Q6K_INPUT_ORDER). The weight is step * (q6 - 32): the
         * 160 x is taken back per group of 16 (`excess16`). Lanes 4j..4j+3 of a dot product
         * hold group 8 half + j (A, C) or 8 half + 4 + j (B, D). */
        const uint8_t *ql = block, *qh = block + 128;
        const __m512 steps = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))),
            _mm512_set1_ps(half_at(block + 208)));
        /* Where each vector's 2 high bits lie in its word of high bits: words 0-15 then 16-31
         * (groups g and g + 1 of 32 values), moved to bits 4-5. */
        const __m512i up_a = _mm512_setr_epi64(0x0004000400040004, 0x0004000400040004,
                                               0x0004000400040004, 0x0004000400040004,
                                               0x0002000200020002, 0x0002000200020002,
                                               0x0002000200020002, 0x0002000200020002);
        const __m512i down_c = _mm512_setr_epi64(0x0004000400040004, 0x0004000400040004,
                                                 0x0004000400040004, 0x0004000400040004,
                                                 0x0006000600060006, 0x0006000600060006,
                                                 0x0006000600060006, 0x0006000600060006);
        const __m512i down_b = _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002,
                                                 0x0002000200020002, 0x0002000200020002,
                                                 0x0002000200020002);
        const __m512i down_d = _mm512_setr_epi64(0x0008000800080008, 0x0008000800080008,
                                                 0x0008000800080008, 0x0008000800080008,
                                                 0x000a000a000a000a, 0x000a000a000a000a,
                                                 0x000a000a000a000a, 0x000a000a000a000a);
        for (int half = 0; half < 2; ++half) {
            const __m512i low = _mm512_loadu_si512((const void *)(ql + 64 * half));
            const __m512i high = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(qh + 32 * half)));
            const __m512i a = q6_code_words(low, _mm512_sllv_epi16(high, up_a));
            const __m512i c = q6_code_words(_mm512_srli_epi16(low, 8),
                                            _mm512_srlv_epi16(high, down_c));
            const __m512i b = q6_code_words(_mm512_srli_epi16(low, 4),
                                            _mm512_srlv_epi16(high, down_b));
            const __m512i d = q6_code_words(_mm512_srli_epi16(low, 12),
                                            _mm512_srlv_epi16(high, down_d));
            const int g = 8 * half;
            const __m512 low_step = _mm512_permutexvar_ps(
                _mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 2, g + 2, g + 2,
                                  g + 2, g + 3, g + 3, g + 3, g + 3),
                steps);
            const __m512 high_step = _mm512_permutexvar_ps(
                _mm512_setr_epi32(g + 4, g + 4, g + 4, g + 4, g + 5, g + 5, g + 5, g + 5, g + 6,
                                  g + 6, g + 6, g + 6, g + 7, g + 7, g + 7, g + 7),
                steps);
            add_chunk_pair(sums, mr, 2 * half, a, b, c, d, low_step, high_step, x + 128 * half,
                           k);
        }
        for (int i = 0; i < mr; ++i) {
            excess16[i] = _mm512_fmadd_ps(steps, _mm512_loadu_ps(group_sums + i * (k / 16)),
                                          excess16[i]);
        }
        break;
    }
    }
}

/* y[i * ldy + r] for input rows i < m and weight rows first <= r < last of `type` (each row k /
 * values whole blocks of `bytes`, rows contiguous); x: bf16 [m, k], chunk_sums: fp32 [m, k / 32]
 * (the sums of each 32 inputs, read by the types with offsets). Inlined with `type` and the row
 * count constant. Every input row's sums are formed alike whatever rows are beside it. */
static inline __attribute__((always_inline)) void bf16_rows_block(
    const int type, const int64_t values, const int64_t bytes, const bf16_codes *t,
    const uint16_t *x, const float *chunk_sums, const float *group_sums, const int mr, int64_t k,
    const uint8_t *row, float *y, int64_t ldy) {
    __m512 sums[BF16_INPUT_ROWS * BF16_SUMS], excess16[BF16_INPUT_ROWS];
    __m256 offsets[BF16_INPUT_ROWS], excess[BF16_INPUT_ROWS];
    for (int i = 0; i < mr; ++i) {
        for (int s = 0; s < BF16_SUMS; ++s) {
            sums[i * BF16_SUMS + s] = _mm512_setzero_ps();
        }
        offsets[i] = _mm256_setzero_ps();
        excess[i] = _mm256_setzero_ps();
        excess16[i] = _mm512_setzero_ps();
    }
    /* A 32-value type's blocks BF16_SUMS at a time, block j into the sums j (a constant). */
    const int64_t step = values == 32 ? BF16_SUMS : 1, blocks_per_row = k / values;
    int64_t b = 0;
    for (; b + step <= blocks_per_row; b += step) {
        _mm_prefetch((const char *)row + b * bytes + PREFETCH_BYTES, _MM_HINT_T0);
        for (int j = 0; j < step; ++j) {
            bf16_block(type, t, row + (b + j) * bytes, mr, j, x + (b + j) * values,
                       chunk_sums + (b + j) * values / 32, group_sums + (b + j) * values / 16, k,
                       sums, offsets, excess, excess16);
        }
    }
    for (; b < blocks_per_row; ++b) {
        bf16_block(type, t, row + b * bytes, mr, 0, x + b * values, chunk_sums + b * values / 32,
                   group_sums + b * values / 16, k, sums, offsets, excess, excess16);
    }
    for (int i = 0; i < mr; ++i) {
        const __m512 *own = &sums[i * BF16_SUMS];
        const __m512 total =
            _mm512_add_ps(_mm512_add_ps(own[0], own[1]), _mm512_add_ps(own[2], own[3]));
        /* Q4_K: the offsets' sums and the 128 x its codes carry; Q6_K: the 160 x (32 for its
         * codes' bias, 128 for bf16(128 + q6)); the multiples of 2 are exact. */
        float offset = 0.0f;
        if (type == GGML_Q4_K) {
            const __m256 taken = _mm256_fmadd_ps(excess[i], _mm256_set1_ps(128.0f), offsets[i]);
            offset = _mm512_reduce_add_ps(_mm512_zextps256_ps512(taken));
        } else if (type == GGML_Q6_K) {
            offset = _mm512_reduce_add_ps(_mm512_mul_ps(excess16[i], _mm512_set1_ps(160.0f)));
        }
        y[i * ldy] = _mm512_reduce_add_ps(total) - offset;
    }
}

static inline __attribute__((always_inline)) void bf16_rows(
    const int type, const int64_t values, const int64_t bytes, const uint16_t *x,
    const float *chunk_sums, int64_t m, int64_t k, const uint8_t *w, int64_t first, int64_t last,
    float *y, int64_t ldy) {
    const bf16_codes t = bf16_code_tables();
    const int64_t row_bytes = k / values * bytes;
    for (int64_t r = first; r < last; ++r) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t i0 = 0; i0 < m; i0 += BF16_INPUT_ROWS) {
            const int64_t rows = m - i0 < BF16_INPUT_ROWS ? m - i0 : BF16_INPUT_ROWS;
            const uint16_t *xi = x + i0 * k;
            const float *si = chunk_sums + i0 * (k / 32);
            /* The sums of each 16 inputs follow those of each 32 (make_bf16_inputs). */
            const float *gi = chunk_sums + m * (k / 32) + i0 * (k / 16);
            float *yi = y + i0 * ldy + r;
            switch (rows) { /* a constant count in each copy */
            case 4: bf16_rows_block(type, values, bytes, &t, xi, si, gi, 4, k, row, yi, ldy); break;
            case 3: bf16_rows_block(type, values, bytes, &t, xi, si, gi, 3, k, row, yi, ldy); break;
            case 2: bf16_rows_block(type, values, bytes, &t, xi, si, gi, 2, k, row, yi, ldy); break;
            default:
                bf16_rows_block(type, values, bytes, &t, xi, si, gi, 1, k, row, yi, ldy);
                break;
            }
        }
    }
}

typedef void (*bf16_rows_fn)(const uint16_t *, const float *, int64_t, int64_t, const uint8_t *,
                             int64_t, int64_t, float *, int64_t);
#define BF16_GEMV(NAME, TYPE, VALUES, BYTES)                                                      \
    static void bf16_gemv_##NAME(const uint16_t *x, const float *chunk_sums, int64_t m,          \
                                 int64_t k, const uint8_t *w, int64_t first, int64_t last,       \
                                 float *y, int64_t ldy) {                                        \
        bf16_rows(TYPE, VALUES, BYTES, x, chunk_sums, m, k, w, first, last, y, ldy);             \
    }
BF16_GEMV(q4_0, GGML_Q4_0, 32, 18)
BF16_GEMV(q5_0, GGML_Q5_0, 32, 22)
BF16_GEMV(q8_0, GGML_Q8_0, 32, 34)
BF16_GEMV(q4_k, GGML_Q4_K, 256, 144)
BF16_GEMV(q6_k, GGML_Q6_K, 256, 210)

/* The bf16 GEMV for `type`, NULL for a type without one or a row length `k` not whole blocks. */
static bf16_rows_fn bf16_gemv_of(int type, int64_t k) {
    block_format f;
    if (block_format_of(type, &f) != 0 || k % f.values != 0) {
        return NULL;
    }
    switch (type) {
    case GGML_Q4_0: return bf16_gemv_q4_0;
    case GGML_Q5_0: return bf16_gemv_q5_0;
    case GGML_Q8_0: return bf16_gemv_q8_0;
    case GGML_Q4_K: return bf16_gemv_q4_k;
    case GGML_Q6_K: return bf16_gemv_q6_k;
    default: return NULL;
    }
}

/* Q4K_INPUT_ORDER: where the Q4_K kernel reads each of a block's 256 inputs: position 128 L +
 * 32 s + w holds value 64 pair + byte % 32 + 32 high, for vector s = A, C, B, D (high: B, D),
 * byte 2w (+1 for C, D) of the block's 64 code bytes L, pair 2L + byte / 32. */
static void q4k_input_order(const uint16_t *in, int64_t count, uint16_t *out) {
    int16_t from[256];
    for (int position = 0; position < 256; ++position) {
        const int L = position / 128, s = position / 32 % 4, w = position % 32;
        const int odd = s & 1, high = s >> 1, byte = 2 * w + odd;
        from[position] = (int16_t)(64 * (2 * L + byte / 32) + byte % 32 + 32 * high);
    }
    for (int64_t block = 0; block < count; block += 256) {
        for (int position = 0; position < 256; ++position) {
            out[block + position] = in[block + from[position]];
        }
    }
}

/* Q6K_INPUT_ORDER: where the Q6_K kernel reads each of a block's inputs: position 128 half +
 * 32 s + w holds value 128 half + 32 group + byte % 32, for vector s = A, C, B, D (B, D: the
 * high nibbles), byte 2w (+1 for C, D) of the half's 64 bytes of low nibbles, group 2 (s >> 1)
 * + byte / 32. */
static void q6k_input_order(const uint16_t *in, int64_t count, uint16_t *out) {
    int16_t from[256];
    for (int position = 0; position < 256; ++position) {
        const int half = position / 128, s = position / 32 % 4, w = position % 32;
        const int byte = 2 * w + (s & 1), group = 2 * (s >> 1) + byte / 32;
        from[position] = (int16_t)(128 * half + 32 * group + byte % 32);
    }
    for (int64_t block = 0; block < count; block += 256) {
        for (int position = 0; position < 256; ++position) {
            out[block + position] = in[block + from[position]];
        }
    }
}

/* x [m, k] fp32 -> bf16 [m, k] (round to nearest even), the fp32 sums of each 32 of those bf16
 * values [m, k / 32] and of each 16 [m, k / 16] (after them); k a multiple of 32. */
static void bf16_inputs(const float *x, int64_t m, int64_t k, uint16_t *out, float *chunk_sums) {
    float *group_sums = chunk_sums + m * k / 32;
    for (int64_t j = 0; j < m * k; j += 32) {
        const __m256bh low = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + j));
        const __m256bh high = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + j + 16));
        _mm256_storeu_si256((__m256i *)(out + j), (__m256i)low);
        _mm256_storeu_si256((__m256i *)(out + j + 16), (__m256i)high);
        const __m512 wide_low = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)low), 16));
        const __m512 wide_high = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)high), 16));
        chunk_sums[j / 32] = _mm512_reduce_add_ps(_mm512_add_ps(wide_low, wide_high));
        group_sums[j / 16] = _mm512_reduce_add_ps(wide_low);
        group_sums[j / 16 + 1] = _mm512_reduce_add_ps(wide_high);
    }
}
#else
#define HAS_BF16_GEMV 0
typedef void (*bf16_rows_fn)(const uint16_t *, const float *, int64_t, int64_t, const uint8_t *,
                             int64_t, int64_t, float *, int64_t);
static bf16_rows_fn bf16_gemv_of(int type, int64_t k) {
    (void)type;
    (void)k;
    return NULL;
}
static void bf16_inputs(const float *x, int64_t m, int64_t k, uint16_t *out, float *chunk_sums) {
    (void)x, (void)m, (void)k, (void)out, (void)chunk_sums;
}
static void q4k_input_order(const uint16_t *in, int64_t count, uint16_t *out) {
    (void)in, (void)count, (void)out;
}
static void q6k_input_order(const uint16_t *in, int64_t count, uint16_t *out) {
    (void)in, (void)count, (void)out;
}
#endif

/* The bf16 GEMV's inputs for m rows of x [m, k]: bf16 values (`plain`), the same in
 * Q4K_INPUT_ORDER and Q6K_INPUT_ORDER where a Q4_K or Q6_K weight reads them (`q4k`, `q6k`;
 * k a multiple of 256), and the sums of each 32 of them then of each 16 (`chunk_sums`), in one
 * allocation (`free(plain)`). Returns -1 when memory runs out. */
typedef struct {
    uint16_t *plain, *q4k, *q6k;
    float *chunk_sums;
} bf16_input_set;

static int make_bf16_inputs(const float *x, int64_t m, int64_t k, int q4k, int q6k,
                            bf16_input_set *in) {
    const size_t words = (size_t)(m * k) * (size_t)(1 + (q4k != 0) + (q6k != 0));
    const size_t sums = (size_t)(m * k / 32 + m * k / 16);
    in->plain = malloc(sizeof(uint16_t) * words + sizeof(float) * sums);
    if (in->plain == NULL) {
        return -1;
    }
    in->q4k = q4k ? in->plain + m * k : NULL;
    in->q6k = q6k ? in->plain + m * k * (q4k ? 2 : 1) : NULL;
    in->chunk_sums = (float *)(in->plain + words);
    bf16_inputs(x, m, k, in->plain, in->chunk_sums);
    if (q4k) {
        q4k_input_order(in->plain, m * k, in->q4k);
    }
    if (q6k) {
        q6k_input_order(in->plain, m * k, in->q6k);
    }
    return 0;
}

/* The inputs a weight of `type` reads. */
static const uint16_t *inputs_for(const bf16_input_set *in, int64_t type) {
    return type == GGML_Q4_K ? in->q4k : type == GGML_Q6_K ? in->q6k : in->plain;
}

/* Whether this build has the bf16 GEMV for GGML type `type`: 1 or 0. */
int hearth_blocks_gemv_bf16_takes(int type) {
    block_format f;
    return block_format_of(type, &f) == 0 && bf16_gemv_of(type, f.values) != NULL;
}

/* hearth_blocks_gemv with x rounded to bf16 and the bf16 GEMV above. Returns -1 for a type
 * without one here (or any type in a build without AVX512-BF16), m outside 1..MAX_INPUT_ROWS,
 * or when memory runs out. */
int hearth_blocks_gemv_bf16(int type, const float *x, int64_t m, int64_t k, const uint8_t *w,
                            int64_t n, float *y, int64_t ldy, int threads) {
    const bf16_rows_fn rows = bf16_gemv_of(type, k);
    if (rows == NULL || m < 1 || m > MAX_INPUT_ROWS) {
        return -1;
    }
    bf16_input_set in;
    if (make_bf16_inputs(x, m, k, type == GGML_Q4_K, type == GGML_Q6_K, &in) != 0) {
        return -1;
    }
    const uint16_t *inputs = inputs_for(&in, type);
    const int64_t units = (n + GEMV_ROWS_PER_UNIT - 1) / GEMV_ROWS_PER_UNIT;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t unit = 0; unit < units; ++unit) {
        const int64_t first = unit * GEMV_ROWS_PER_UNIT;
        const int64_t last = first + GEMV_ROWS_PER_UNIT < n ? first + GEMV_ROWS_PER_UNIT : n;
        rows(inputs, in.chunk_sums, m, k, w, first, last, y, ldy);
    }
    free(in.plain);
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * fp32 decode glue (a CPU fp32 step, e.g. on GGUF blocks kept as stored): the ops of
 * hearth/ops/norm.py and rope.py's references in fp32, one call instead of a dozen torch ops.
 * Products and sums are rounded one at a time as torch's eager ops round them (no contraction);
 * only the order of the mean's sum differs (a last-bit effect).
 */

/* out = (x * inverse_rms(x)) * w for one row of h fp32 values (w NULL: no weight). */
NO_FMA static void rms_norm_row_f32(const float *x, const float *w, int64_t h, float eps,
                                    float *out) {
    const float scale = inverse_rms(x, h, eps);
    for (int64_t j = 0; j < h; ++j) {
        const float normed = x[j] * scale;
        out[j] = w == NULL ? normed : normed * w[j];
    }
}

/* summed = residual + norm(x) * w; normed = norm(summed) * w_next (skipped when normed is NULL).
 * All of [rows, h] fp32, contiguous; w, w_next fp32 [h]. Returns -1 when memory runs out. */
NO_FMA int hearth_add_rms_norm_f32(const float *residual, const float *x, int64_t rows,
                                   int64_t h, const float *w, const float *w_next, float eps,
                                   float *summed, float *normed) {
    float *row = malloc(sizeof(float) * (size_t)h);
    if (row == NULL) {
        return -1;
    }
    for (int64_t i = 0; i < rows; ++i) {
        rms_norm_row_f32(x + i * h, w, h, eps, row);
        for (int64_t j = 0; j < h; ++j) {
            summed[i * h + j] = residual[i * h + j] + row[j];
        }
        if (normed != NULL) {
            rms_norm_row_f32(summed + i * h, w_next, h, eps, normed + i * h);
        }
    }
    free(row);
    return 0;
}

/* Rotate-half RoPE on one normed fp32 head with fp32 cos/sin [d]: x * cos + rotate_half(x) * sin,
 * rotate_half(x) = (-x2, x1), each product rounded, then their sum. */
NO_FMA static void rope_row_f32(const float *x, const float *cos, const float *sin, int64_t d,
                                float *out) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < d; ++j) {
        const float rotated = j < half ? -x[j + half] : x[j - half];
        const float straight = x[j] * cos[j];
        const float turned = rotated * sin[j];
        out[j] = straight + turned;
    }
}

/* As hearth_norm_rope, in fp32: q and k heads of qkv [tokens, width] get RMSNorm (q_w / k_w,
 * fp32 [d]) then RoPE with that token's cos/sin [tokens, d]; v heads are copied. */
int hearth_norm_rope_f32(const float *qkv, int64_t tokens, int64_t width, int64_t q_heads,
                         int64_t kv_heads, int64_t d, const float *q_w, const float *k_w,
                         const float *cos, const float *sin, float eps, float *q, float *k,
                         float *v) {
    float *normed = malloc(sizeof(float) * (size_t)d);
    if (normed == NULL) {
        return -1;
    }
    for (int64_t t = 0; t < tokens; ++t) {
        const float *source = qkv + t * width;
        for (int64_t head = 0; head < q_heads + kv_heads; ++head) {
            const int is_q = head < q_heads;
            rms_norm_row_f32(source + head * d, is_q ? q_w : k_w, d, eps, normed);
            float *target = is_q ? q + (t * q_heads + head) * d
                                 : k + (t * kv_heads + head - q_heads) * d;
            rope_row_f32(normed, cos + t * d, sin + t * d, d, target);
        }
        memcpy(v + t * kv_heads * d, source + (q_heads + kv_heads) * d,
               sizeof(float) * (size_t)(kv_heads * d));
    }
    free(normed);
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * A whole Gemma 3 decoder layer over GGUF blocks kept as stored, fp32 activations, at one
 * decode token of each of `batch` sequences (each with its own cache), in one call: the ops of
 * hearth/models/gemma3.py in its order, each of them the kernel the module path runs (the block
 * GEMV, the fp32 add + RMSNorm, the fp32 q/k norm + RoPE), except attention (the module path's
 * is torch's SDPA) and GELU (torch's vectorised tanh; here libm's): the result is the module
 * path's up to the order of fp32 sums in attention and the last bits of tanh.
 */

/* Segments a projection's rows may be stored in (a q/k/v stack of three types at most). */
#define BLOCKS_MAX_SEGMENTS 4

/* A projection over GGML blocks: its output rows in `segments` runs, run s `rows[s]` rows of
 * type `type[s]` stored contiguously at `blocks[s]`; bf16[s] 1: run s takes the bf16 GEMV
 * (inputs rounded to bf16) where this build has one for its type, else the fp32 one. */
typedef struct {
    int64_t segments;
    int64_t type[BLOCKS_MAX_SEGMENTS];
    int64_t rows[BLOCKS_MAX_SEGMENTS];
    const uint8_t *blocks[BLOCKS_MAX_SEGMENTS];
    int64_t bf16[BLOCKS_MAX_SEGMENTS];
} hearth_blocks_weight;

/* A Gemma 3 layer's fixed operands over blocks (read-only); norm weights fp32, already 1 + w. */
typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, intermediate;
    hearth_blocks_weight qkv, o, gate_up, down;
    const float *q_norm, *k_norm, *post_attention_norm, *pre_feedforward_norm;
    const float *post_feedforward_norm, *next_norm;
    float eps, scale;
} hearth_blocks_layer;

/* y [m, rows] (row stride ldy) = x [m, k] @ W^T over every segment of `w`: each segment's rows
 * as hearth_blocks_gemv computes them, all segments' units of rows in one parallel region. */
static int blocks_project(const hearth_blocks_weight *w, const float *x, int64_t m, int64_t k,
                          float *y, int64_t ldy, int threads) {
    gemv_rows_fn rows[BLOCKS_MAX_SEGMENTS];
    bf16_rows_fn bf16_segment[BLOCKS_MAX_SEGMENTS];
    int64_t first_row[BLOCKS_MAX_SEGMENTS], first_unit[BLOCKS_MAX_SEGMENTS + 1];
    if (w->segments < 1 || w->segments > BLOCKS_MAX_SEGMENTS || m < 1 || m > MAX_INPUT_ROWS) {
        return -1;
    }
    first_unit[0] = 0;
    int any_bf16 = 0, any_q4k = 0, any_q6k = 0;
    for (int64_t s = 0; s < w->segments; ++s) {
        block_format f;
        rows[s] = gemv_of((int)w->type[s], k, &f);
        if (rows[s] == NULL) {
            return -1;
        }
        bf16_segment[s] = w->bf16[s] ? bf16_gemv_of((int)w->type[s], k) : NULL;
        any_bf16 |= bf16_segment[s] != NULL;
        any_q4k |= bf16_segment[s] != NULL && w->type[s] == GGML_Q4_K;
        any_q6k |= bf16_segment[s] != NULL && w->type[s] == GGML_Q6_K;
        first_row[s] = s == 0 ? 0 : first_row[s - 1] + w->rows[s - 1];
        first_unit[s + 1] = first_unit[s] + (w->rows[s] + GEMV_ROWS_PER_UNIT - 1) /
                                                GEMV_ROWS_PER_UNIT;
    }
    /* The bf16 GEMV's inputs, made once for all its segments. */
    bf16_input_set in = {NULL, NULL, NULL, NULL};
    if (any_bf16 && make_bf16_inputs(x, m, k, any_q4k, any_q6k, &in) != 0) {
        return -1;
    }
    const int64_t units = first_unit[w->segments];
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t unit = 0; unit < units; ++unit) {
        int64_t s = 0;
        while (unit >= first_unit[s + 1]) {
            ++s;
        }
        const int64_t first = (unit - first_unit[s]) * GEMV_ROWS_PER_UNIT;
        const int64_t last = first + GEMV_ROWS_PER_UNIT < w->rows[s] ? first + GEMV_ROWS_PER_UNIT
                                                                     : w->rows[s];
        if (bf16_segment[s] != NULL) {
            bf16_segment[s](inputs_for(&in, w->type[s]), in.chunk_sums, m, k, w->blocks[s], first,
                            last, y + first_row[s], ldy);
        } else {
            rows[s](x, m, k, w->blocks[s], first, last, y + first_row[s], ldy);
        }
    }
    free(in.plain);
    return 0;
}

/* e^x in fp32 for x in [-87, 88] (clamped there): x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in
 * two parts, Cody and Waite), e^r by its degree-6 Taylor polynomial (error under 2e-8 of it),
 * times 2^n made in the exponent bits. Within ~2 ulp of e^x; plain arithmetic that a loop of
 * it vectorises. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693145751953125f, x);
    r = fmaf(n, -1.428606765330187045e-06f, r);
    float p = 1.0f / 720.0f;
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out = gelu_tanh(gate) * up for `rows` rows of gate_up [rows, 2n] (gate then up), fp32:
 * torch's F.gelu(approximate="tanh"), 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3),
 * formed as x / (1 + e^(-2u)) (the same function: 0.5 (1 + tanh u) is the logistic of 2u), whose
 * rounding error is a few ulp of the result where torch's vectorised tanh has its own. */
static void geglu_rows_f32(const float *gate_up, int64_t rows, int64_t n, float *out) {
    const float beta = 0.797884560802865355f, kappa = 0.044715f;
    for (int64_t i = 0; i < rows; ++i) {
        const float *gate = gate_up + i * 2 * n, *up = gate + n;
        float *row = out + i * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
            const float x = gate[j];
            const float u = beta * (x + kappa * x * x * x);
            row[j] = x / (1.0f + exp_f32(-2.0f * u)) * up[j];
        }
    }
}

/* geglu_rows_f32 as an entry point (tests compare it with torch's). */
int hearth_geglu_f32(const float *gate_up, int64_t rows, int64_t n, float *out) {
    geglu_rows_f32(gate_up, rows, n, out);
    return 0;
}

/* Where sequence b's K/V lie (hearth_gemma3_blocks_layer's `caches`, int64 [batch, 10], row
 * b): its fp32 key and value planes (addresses), its block table (an address; 0: the planes
 * are one contiguous buffer), the head stride (contiguous) or the block size (paged), where its
 * new K/V go (a slot, or a position), the number of keys attention reads, and (paged) the two
 * runs of positions it reads them in: first0, count0, first1, count1. */
enum { CACHE_KEYS, CACHE_VALUES, CACHE_TABLE, CACHE_STRIDE, CACHE_WRITTEN, CACHE_LENGTH,
       CACHE_FIRST0, CACHE_COUNT0, CACHE_FIRST1, CACHE_COUNT1, CACHE_FIELDS };

/* x [batch, hidden] (each sequence's residual stream) and normed [batch, hidden] (its input
 * norm) are updated in place: x becomes the layer's output, normed its norm by next_norm. cos,
 * sin: fp32 [batch, head_dim] at each sequence's position. Sequence b's cache is row b of
 * `caches` (above). Contiguous: its new K and V go into slot `written` (head h's slot t at
 * h * head_stride + t * head_dim), and attention reads slots 0..length-1. Paged: its new K/V go
 * straight into position `written`'s block, and attention reads the positions of its two runs
 * in their order (so the sums are those over a contiguous copy of them in that order, bit for
 * bit). Returns -1 when memory runs out or a block type is not handled. */
int hearth_gemma3_blocks_layer(const hearth_blocks_layer *layer, int64_t batch, float *x,
                               float *normed, const float *cos, const float *sin,
                               const int64_t *caches, int threads) {
    const int64_t d = layer->head_dim, h = layer->hidden, inner = layer->intermediate;
    const int64_t q_width = layer->q_heads * d, kv_width = layer->kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const int64_t per_row = qkv_width + q_width + 2 * kv_width + h + 3 * inner;
    float *work = malloc(sizeof(float) * (size_t)(batch * per_row));
    if (work == NULL) {
        return -1;
    }
    float *qkv = work, *q = qkv + batch * qkv_width, *k = q + batch * q_width;
    float *v = k + batch * kv_width, *projected = v + batch * kv_width;
    float *gate_up = projected + batch * h, *activated = gate_up + batch * 2 * inner;
    int status = -1;
    if (blocks_project(&layer->qkv, normed, batch, h, qkv, qkv_width, threads) != 0 ||
        hearth_norm_rope_f32(qkv, batch, qkv_width, layer->q_heads, layer->kv_heads, d,
                             layer->q_norm, layer->k_norm, cos, sin, layer->eps, q, k,
                             v) != 0) {
        goto done;
    }
    kv_layout layouts[MAX_INPUT_ROWS];
    int64_t lengths[MAX_INPUT_ROWS];
    if (batch > MAX_INPUT_ROWS) {
        goto done;
    }
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t *cache = caches + b * CACHE_FIELDS;
        float *key_plane = (float *)(intptr_t)cache[CACHE_KEYS];
        float *value_plane = (float *)(intptr_t)cache[CACHE_VALUES];
        const int64_t *table = (const int64_t *)(intptr_t)cache[CACHE_TABLE];
        layouts[b] = (kv_layout){
            .k = key_plane,
            .v = value_plane,
            .group_stride = table == NULL ? cache[CACHE_STRIDE] : 0,
            .table = table,
            .block_size = table == NULL ? 0 : cache[CACHE_STRIDE],
            .kv_heads = layer->kv_heads,
            .first = {cache[CACHE_FIRST0], cache[CACHE_FIRST1]},
            .count = {cache[CACHE_COUNT0], cache[CACHE_COUNT1]},
        };
        lengths[b] = cache[CACHE_LENGTH];
        for (int64_t head = 0; head < layer->kv_heads; ++head) {
            const int64_t at = kv_at(&layouts[b], head, cache[CACHE_WRITTEN], d);
            memcpy(key_plane + at, k + (b * layer->kv_heads + head) * d, sizeof(float) * (size_t)d);
            memcpy(value_plane + at, v + (b * layer->kv_heads + head) * d,
                   sizeof(float) * (size_t)d);
        }
    }
    /* Every sequence's attention in one parallel region; the query heads become their
     * output, in place. */
    if (attention_rows(q, q_width, layouts, lengths, batch, 1, layer->kv_heads,
                       layer->q_heads / layer->kv_heads, d, layer->scale, threads) != 0) {
        goto done;
    }
    if (blocks_project(&layer->o, q, batch, q_width, projected, h, threads) != 0 ||
        hearth_add_rms_norm_f32(x, projected, batch, h, layer->post_attention_norm,
                                layer->pre_feedforward_norm, layer->eps, x, normed) != 0 ||
        blocks_project(&layer->gate_up, normed, batch, h, gate_up, 2 * inner, threads) != 0) {
        goto done;
    }
    geglu_rows_f32(gate_up, batch, inner, activated);
    if (blocks_project(&layer->down, activated, batch, inner, projected, h, threads) != 0) {
        goto done;
    }
    status = hearth_add_rms_norm_f32(x, projected, batch, h, layer->post_feedforward_norm,
                                     layer->next_norm, layer->eps, x, normed);
done:
    free(work);
    return status;
}

/* ------------------------------------------------------------------------------------------
 * A whole Gemma 4 dense decoder layer over GGUF blocks kept as stored, fp32 activations, at one
 * decode token, in one call: hearth_gemma4_decode_layer's steps (q/k norms, V made as the layer's
 * value mode says, RoPE, the KV-sharing layers reading their donor's planes, the sandwich norms,
 * the per-layer input's gate and projection, the layer scalar) in the order of
 * hearth/models/gemma4.py, each of them the kernel or the fp32 op the module path runs, except
 * attention (the module path's is torch's SDPA) and GELU (here exp_f32's logistic form): the
 * result is the module path's up to the order of fp32 sums there and the last bits of tanh.
 */

/* A Gemma 4 layer's fixed operands over blocks (read-only): `base` as for Gemma 3 (norm weights
 * fp32 w, Gemma 4 has no 1 + w; k_norm NULL on a KV-sharing layer; scale 1), value_mode as
 * hearth_gemma4_layer's (0: a KV-sharing layer, its qkv holds Q only; 2: V its own projection
 * RMS-normalised without weight; 3: V the raw K so normalised, its qkv holds Q and K), the
 * per-layer input's gate [per_layer, hidden] and projection [hidden, per_layer] over blocks
 * with the norm after them (per_layer 0: none), and the fp32 layer scalar [1]. */
typedef struct {
    hearth_blocks_layer base;
    int64_t per_layer, value_mode;
    hearth_blocks_weight per_layer_gate, per_layer_projection;
    const float *post_per_layer_norm;
    const float *layer_scalar;
} hearth_gemma4_blocks_operands;

/* x = (x + norm(branch) * w) * scalar; normed = norm(x) * w_next, for one row of h fp32 values:
 * add_rms_norm_reference's ops and roundings, one at a time. branch: [h] room, overwritten. */
NO_FMA static void add_rms_norm_scaled_f32(float *x, float *branch, int64_t h, const float *w,
                                           const float *scalar, const float *w_next, float eps,
                                           float *normed) {
    rms_norm_row_f32(branch, w, h, eps, branch);
    for (int64_t j = 0; j < h; ++j) {
        x[j] = (x[j] + branch[j]) * scalar[0];
    }
    rms_norm_row_f32(x, w_next, h, eps, normed);
}

/* q heads of qkv: RMSNorm by q_norm, then RoPE, into q [q_heads, d]. With a value mode, k heads:
 * RMSNorm by k_norm and RoPE into slot `slot` of `keys`, and V made as the mode says into that
 * slot of `values` (hearth.ops.rope.norm_rope_reference at one token). row: [d] room. */
static void gemma4_blocks_norm_rope(const hearth_gemma4_blocks_operands *gemma4,
                                    const float *qkv, const float *cos, const float *sin,
                                    float *q, float *keys, float *values, int64_t head_stride,
                                    int64_t slot, float *row) {
    const hearth_blocks_layer *layer = &gemma4->base;
    const int64_t d = layer->head_dim, kv_start = layer->q_heads * d;
    for (int64_t head = 0; head < layer->q_heads; ++head) {
        rms_norm_row_f32(qkv + head * d, layer->q_norm, d, layer->eps, row);
        rope_row_f32(row, cos, sin, d, q + head * d);
    }
    for (int64_t head = 0; gemma4->value_mode != 0 && head < layer->kv_heads; ++head) {
        const float *raw_k = qkv + kv_start + head * d;
        const int64_t at = head * head_stride + slot * d;
        rms_norm_row_f32(raw_k, layer->k_norm, d, layer->eps, row);
        rope_row_f32(row, cos, sin, d, keys + at);
        /* value mode 3 (k_eq_v): V from the raw K; else 2: from its own projection. */
        const float *raw_v =
            gemma4->value_mode == 3 ? raw_k : qkv + kv_start + (layer->kv_heads + head) * d;
        rms_norm_row_f32(raw_v, NULL, d, layer->eps, values + at);
    }
}

/* x [hidden] (the residual stream) and normed [hidden] (its input norm) are updated in place:
 * x becomes the layer's output, normed its norm by next_norm. cos, sin: fp32 [head_dim] at this
 * position. A layer that owns K/V writes them into slot `slot` of its fp32 planes keys/values
 * (head h's slot t at h * head_stride + t * head_dim); a KV-sharing one (value_mode 0, slot
 * ignored) reads its donor's. Attention reads slots 0..length-1. per_layer_input: fp32
 * [per_layer] (NULL without). Returns -1 when memory runs out or a block type is not handled. */
int hearth_gemma4_blocks_layer(const hearth_gemma4_blocks_operands *gemma4, float *x,
                               float *normed, const float *cos, const float *sin, float *keys,
                               float *values, int64_t head_stride, int64_t slot, int64_t length,
                               const float *per_layer_input, int threads) {
    const hearth_blocks_layer *layer = &gemma4->base;
    const int64_t d = layer->head_dim, h = layer->hidden, inner = layer->intermediate;
    const int64_t ple = gemma4->per_layer, q_width = layer->q_heads * d;
    const int64_t kv_parts = gemma4->value_mode == 0 ? 0 : gemma4->value_mode == 3 ? 1 : 2;
    const int64_t qkv_width = q_width + kv_parts * layer->kv_heads * d;
    float *work = malloc(sizeof(float) * (size_t)(qkv_width + q_width + d + h + 3 * inner +
                                                  3 * ple));
    if (work == NULL) {
        return -1;
    }
    float *qkv = work, *q = qkv + qkv_width, *row = q + q_width, *projected = row + d;
    float *gate_up = projected + h, *activated = gate_up + 2 * inner;
    float *ple_gate_input = activated + inner, *ple_activated = ple_gate_input + 2 * ple;
    int status = -1;
    if (blocks_project(&layer->qkv, normed, 1, h, qkv, qkv_width, threads) != 0) {
        goto done;
    }
    gemma4_blocks_norm_rope(gemma4, qkv, cos, sin, q, keys, values, head_stride, slot, row);
    /* The query heads become their attention output, in place. */
    const kv_layout layout = {.k = keys, .v = values, .group_stride = head_stride};
    if (attention_heads(q, &layout, 1, layer->kv_heads, layer->q_heads / layer->kv_heads, d,
                        length, layer->scale, threads) != 0 ||
        blocks_project(&layer->o, q, 1, q_width, projected, h, threads) != 0 ||
        hearth_add_rms_norm_f32(x, projected, 1, h, layer->post_attention_norm,
                                layer->pre_feedforward_norm, layer->eps, x, normed) != 0 ||
        blocks_project(&layer->gate_up, normed, 1, h, gate_up, 2 * inner, threads) != 0) {
        goto done;
    }
    geglu_rows_f32(gate_up, 1, inner, activated);
    if (blocks_project(&layer->down, activated, 1, inner, projected, h, threads) != 0) {
        goto done;
    }
    if (ple == 0) {
        add_rms_norm_scaled_f32(x, projected, h, layer->post_feedforward_norm,
                                gemma4->layer_scalar, layer->next_norm, layer->eps, normed);
        status = 0;
        goto done;
    }
    /* x += norm(down) * w; the gate reads that x, its GeGLU's "up" is the per-layer input. */
    if (hearth_add_rms_norm_f32(x, projected, 1, h, layer->post_feedforward_norm, NULL,
                                layer->eps, x, NULL) != 0 ||
        blocks_project(&gemma4->per_layer_gate, x, 1, h, ple_gate_input, ple, threads) != 0) {
        goto done;
    }
    memcpy(ple_gate_input + ple, per_layer_input, sizeof(float) * (size_t)ple);
    geglu_rows_f32(ple_gate_input, 1, ple, ple_activated);
    if (blocks_project(&gemma4->per_layer_projection, ple_activated, 1, ple, projected, h,
                       threads) != 0) {
        goto done;
    }
    add_rms_norm_scaled_f32(x, projected, h, gemma4->post_per_layer_norm, gemma4->layer_scalar,
                            layer->next_norm, layer->eps, normed);
    status = 0;
done:
    free(work);
    return status;
}

/* ------------------------------------------------------------------------------------------
 * 5. Prefill GEMM on GGML blocks with AMX bf16 tiles: y[m, n] = sum_k x[m, k] * w[n, k] for
 * many input rows, the weights the file's exact values. Per group of 16 or 32 values along k
 * (a block's unit of one step and offset), one TDPBF16PS multiplies 16 input rows (bf16) by 16
 * weight rows' integer codes (exact in bf16: |q| <= 128) into a 16 x 16 fp32 tile, which is
 * then scaled in fp32: acc += step[n, g] * C (- offset[n, g] * xsum[m, g] for affine types).
 * So the weights are never rounded; the activations are rounded to bf16 (`split` 0) or split
 * into two bf16 halves x = hi + lo (`split` 1, ~16 significant bits; two TDPBF16PS a group).
 * Codes are packed per 64 weight rows (4 tiles) into the tile layout (pairs of k) once, then
 * reused for every 16 input rows. Linux grants a process AMX tile state on request (once).
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_CHUNK_ROWS 64 /* weight rows packed at a time: four 16-row tiles */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* 1 where the kernel asked Linux for the tile state and got it, -1 where refused. */
static int amx_permission(void) {
    static int state;
    int seen = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (seen == 0) {
        seen = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, seen, __ATOMIC_RELEASE);
    }
    return seen;
}

/* Tiles 0, 1: fp32 sums (16 x 16); 2-5: input rows hi, lo of two groups (16 x group bf16);
 * 6, 7: codes of two groups (group / 2 pairs x 16 weight rows). */
static void amx_configure(int64_t group) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = t >= 6 ? (uint8_t)(group / 2) : 16;
        config.colsb[t] = t >= 2 && t <= 5 ? (uint16_t)(2 * group) : 64;
    }
    _tile_loadconfig(&config);
}

/* Types with an offset per group (w = step * q - offset). */
static int amx_affine(int type) {
    return type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q2_K || type == GGML_Q4_K ||
           type == GGML_Q5_K;
}

/* 32 int8 codes -> 32 bf16 (exact: |q| <= 128 has at most 8 significant bits). */
static inline void codes_to_bf16(const int8_t *codes, uint16_t *out) {
    const __m512 low =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
    const __m512 high =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16))));
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(high, low));
}

/* r[i] <- column i of the 16 x 16 matrix of 32-bit words whose rows are r[0..15]. */
static inline __attribute__((always_inline)) void transpose16x16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8) {
        for (int i = 0; i < 4; ++i) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Weight rows [first, first + rows) (rows <= 64) -> `packed` [tiles][k / 2][16] pairs of bf16
 * codes, `steps` and `offsets` [groups][64] (zero for the padding rows). */
static void amx_pack_chunk(const block_format f, const uint8_t *w, int64_t k, int64_t first,
                           int64_t rows, uint32_t *packed, float *steps, float *offsets,
                           uint16_t *scratch) {
    const int64_t row_bytes = k / f.values * f.bytes, groups = k / f.group;
    const int64_t per_block = f.values / f.group;
    for (int64_t tile = 0; tile * 16 < rows; ++tile) {
        for (int64_t r = 0; r < 16; ++r) {
            const int64_t local = tile * 16 + r;
            uint16_t *out = scratch + r * k;
            if (local >= rows) {
                memset(out, 0, sizeof(uint16_t) * (size_t)k);
                for (int64_t g = 0; g < groups; ++g) {
                    steps[g * AMX_CHUNK_ROWS + local] = 0.0f;
                    offsets[g * AMX_CHUNK_ROWS + local] = 0.0f;
                }
                continue;
            }
            const uint8_t *row = w + (first + local) * row_bytes;
            for (int64_t b = 0; b < k / f.values; ++b) {
                unpacked_block u;
                const int8_t *codes = f.unpack(row + b * f.bytes, &u);
                for (int64_t j = 0; j < f.values; j += 32) {
                    codes_to_bf16(codes + j, out + b * f.values + j);
                }
                for (int64_t g = 0; g < per_block; ++g) {
                    steps[(b * per_block + g) * AMX_CHUNK_ROWS + local] = u.step[g];
                    offsets[(b * per_block + g) * AMX_CHUNK_ROWS + local] = u.offset[g];
                }
            }
        }
        /* Transpose pairs: tile row p holds pair p of each of the 16 weight rows. */
        const int32_t *pairs = (const int32_t *)scratch;
        uint32_t *tile_out = packed + tile * (k / 2) * 16;
        for (int64_t p = 0; p < k / 2; p += 16) {
            __m512i rows16[16];
            for (int r = 0; r < 16; ++r) {
                rows16[r] = _mm512_loadu_si512(pairs + r * (k / 2) + p);
            }
            transpose16x16(rows16);
            for (int i = 0; i < 16; ++i) {
                _mm512_storeu_si512(tile_out + (p + i) * 16, rows16[i]);
            }
        }
    }
}

/* x [m, k] fp32 -> hi (and lo) bf16 [padded / 16][k / group][16][group], padding rows zero;
 * xsum [padded][groups] the fp32 sum of each group of hi + lo (affine types; else NULL). */
static void amx_inputs(const float *x, int64_t m, int64_t padded, int64_t k, int64_t group,
                       int split, uint16_t *hi, uint16_t *lo, float *xsum, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < padded; ++r) {
        for (int64_t j = 0; j < k; j += 16) {
            const __m512 v = r < m ? _mm512_loadu_ps(x + r * k + j) : _mm512_setzero_ps();
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
            const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            /* Tile order: [16-row block][group][row][value], one A tile contiguous. */
            const int64_t at =
                ((r / 16 * (k / group) + j / group) * 16 + r % 16) * group + j % group;
            _mm256_storeu_si256((__m256i *)(hi + at), h);
            __m512 kept = hv;
            if (split) {
                const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hv));
                _mm256_storeu_si256((__m256i *)(lo + at), l);
                kept = _mm512_add_ps(
                    hv, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(l), 16)));
            }
            if (xsum != NULL) {
                const int64_t g = j / group;
                const float part = _mm512_reduce_add_ps(kept);
                float *sum = xsum + r * (k / group) + g;
                *sum = (j % group == 0 ? 0.0f : *sum) + part;
            }
        }
    }
}

/* acc[r] += step * C[r] (- offset * xsum[r]) over a stored 16 x 16 sum tile. */
static inline __attribute__((always_inline)) void amx_scale(__m512 *acc, const float *sums,
                                                            __m512 step, __m512 offset,
                                                            const float *xsum, int64_t stride,
                                                            int affine) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
        acc[r] = _mm512_fmadd_ps(step, _mm512_load_ps(sums + 16 * r), acc[r]);
        if (affine) {
            acc[r] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(xsum[r * stride]), acc[r]);
        }
    }
}

/* In amx_chunk_rows_of: tile C = the 16 input rows' group g (hi in tile A_HI, and lo in A_LO
 * when split) times the codes of tile B, loaded from `codes_at`. */
#define AMX_GROUP_DOT(C, A_HI, A_LO, B, codes_at, g)                                            \
    do {                                                                                        \
        _tile_zero(C);                                                                          \
        _tile_loadd(A_HI, hi_rows + (g) * 16 * group, ld);                                      \
        _tile_loadd(B, (codes_at) + (g) * (group / 2) * 16, 64);                                \
        _tile_dpbf16ps(C, A_HI, B);                                                             \
        if (split) {                                                                            \
            _tile_loadd(A_LO, lo_rows + (g) * 16 * group, ld);                                  \
            _tile_dpbf16ps(C, A_LO, B);                                                         \
        }                                                                                       \
    } while (0)

/* acc += tile C's sums scaled by group g's steps (less offsets times the rows' sums). */
#define AMX_GROUP_SCALE(C, acc, g)                                                              \
    do {                                                                                        \
        _tile_stored(C, sums[C], 64);                                                           \
        amx_scale(acc, sums[C], _mm512_loadu_ps(step + (g) * AMX_CHUNK_ROWS),                   \
                  _mm512_loadu_ps(offset + (g) * AMX_CHUNK_ROWS),                               \
                  affine ? xsum_rows + (g) : NULL, groups, affine);                             \
    } while (0)

/* Rows [first, first + rows) of y for all padded input rows, from one packed chunk: per 16
 * input rows, two 16-row weight tiles at a time (sum tiles 0 and 1, each input tile loaded once
 * for both; an odd last tile alone), their 16 x 16 results held in registers over the groups.
 * (Measured: per-tile sums kept in memory, or 4 weight tiles a pass, ran slower.) */
static inline __attribute__((always_inline)) void amx_chunk_rows_of(
    const uint16_t *hi, const uint16_t *lo, const float *xsum, int64_t m, int64_t padded,
    int64_t k, const int64_t group, const int split, const int affine, const uint32_t *packed,
    const float *steps, const float *offsets, int64_t first, int64_t rows, float *y,
    int64_t ldy) {
    const int64_t groups = k / group, tiles = (rows + 15) / 16, ld = 2 * group;
    float sums[2][256] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < padded; m0 += 16) {
        const uint16_t *hi_rows = hi + m0 * k, *lo_rows = split ? lo + m0 * k : NULL;
        const float *xsum_rows = affine ? xsum + m0 * groups : NULL;
        int64_t tile = 0;
        /* Two weight tiles at a time: each input tile loaded once for both. */
        for (; tile + 1 < tiles; tile += 2) {
            const uint32_t *codes = packed + tile * (k / 2) * 16;
            const uint32_t *codes_next = codes + (k / 2) * 16;
            const float *step = steps + 16 * tile, *offset = offsets + 16 * tile;
            __m512 acc[16], acc_next[16];
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r) {
                acc[r] = _mm512_setzero_ps();
                acc_next[r] = _mm512_setzero_ps();
            }
            for (int64_t g = 0; g < groups; ++g) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_loadd(4, hi_rows + g * 16 * group, ld);
                _tile_loadd(6, codes + g * (group / 2) * 16, 64);
                _tile_loadd(7, codes_next + g * (group / 2) * 16, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (split) {
                    _tile_loadd(5, lo_rows + g * 16 * group, ld);
                    _tile_dpbf16ps(0, 5, 6);
                    _tile_dpbf16ps(1, 5, 7);
                }
                const float *xsum_g = affine ? xsum_rows + g : NULL;
                _tile_stored(0, sums[0], 64);
                amx_scale(acc, sums[0], _mm512_loadu_ps(step + g * AMX_CHUNK_ROWS),
                          _mm512_loadu_ps(offset + g * AMX_CHUNK_ROWS), xsum_g, groups, affine);
                _tile_stored(1, sums[1], 64);
                amx_scale(acc_next, sums[1], _mm512_loadu_ps(step + g * AMX_CHUNK_ROWS + 16),
                          _mm512_loadu_ps(offset + g * AMX_CHUNK_ROWS + 16), xsum_g, groups,
                          affine);
            }
            const int64_t columns = rows - 16 * tile - 16 < 16 ? rows - 16 * tile - 16 : 16;
            const __mmask16 keep = (__mmask16)((1u << columns) - 1u);
            for (int r = 0; r < 16 && m0 + r < m; ++r) {
                float *out = y + (m0 + r) * ldy + first + 16 * tile;
                _mm512_storeu_ps(out, acc[r]);
                _mm512_mask_storeu_ps(out + 16, keep, acc_next[r]);
            }
        }
        for (; tile < tiles; ++tile) {
            const uint32_t *codes = packed + tile * (k / 2) * 16;
            const float *step = steps + 16 * tile, *offset = offsets + 16 * tile;
            __m512 acc[16];
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r) {
                acc[r] = _mm512_setzero_ps();
            }
            int64_t g = 0;
            for (; g + 1 < groups; g += 2) {
                AMX_GROUP_DOT(0, 4, 5, 6, codes, g);
                AMX_GROUP_DOT(1, 2, 3, 7, codes, g + 1);
                AMX_GROUP_SCALE(0, acc, g);
                AMX_GROUP_SCALE(1, acc, g + 1);
            }
            if (g < groups) {
                AMX_GROUP_DOT(0, 4, 5, 6, codes, g);
                AMX_GROUP_SCALE(0, acc, g);
            }
            const int64_t columns = rows - 16 * tile < 16 ? rows - 16 * tile : 16;
            const __mmask16 keep = (__mmask16)((1u << columns) - 1u);
            for (int r = 0; r < 16 && m0 + r < m; ++r) {
                _mm512_mask_storeu_ps(y + (m0 + r) * ldy + first + 16 * tile, keep, acc[r]);
            }
        }
    }
}

/* amx_chunk_rows_of compiled for each group size, split and affinity. */
static void amx_chunk_rows(const uint16_t *hi, const uint16_t *lo, const float *xsum, int64_t m,
                           int64_t padded, int64_t k, int64_t group, int split, int affine,
                           const uint32_t *packed, const float *steps, const float *offsets,
                           int64_t first, int64_t rows, float *y, int64_t ldy) {
#define AMX_CASE(G, S, A)                                                                       \
    if (group == (G) && split == (S) && affine == (A)) {                                        \
        amx_chunk_rows_of(hi, lo, xsum, m, padded, k, G, S, A, packed, steps, offsets, first,   \
                          rows, y, ldy);                                                        \
        return;                                                                                 \
    }
    AMX_CASE(32, 1, 0)
    AMX_CASE(32, 1, 1)
    AMX_CASE(32, 0, 0)
    AMX_CASE(32, 0, 1)
    AMX_CASE(16, 1, 0)
    AMX_CASE(16, 1, 1)
    AMX_CASE(16, 0, 0)
    AMX_CASE(16, 0, 1)
#undef AMX_CASE
}

/* ------------------------------------------------------------------------------------------
 * The same product for a decode step's few input rows (m <= 16), where packing the weights into
 * B tiles (a transpose per 16 rows) would cost more than the products: the roles swap. The
 * weights go in the A tile as stored, 16 weight rows x one group of codes (no transpose); the
 * inputs, made once a call, go in B tiles (pairs of k x 16 input rows, padding rows zero). The
 * 16 x 16 sum tile's row r is weight row r against every input row, scaled per row by its
 * step: acc[r] += step[r, g] * C[r] (- offset[r, g] * xsum[g], a vector over input rows). */

/* x [m, k] -> hi (and lo) [k / 2][16] pairs of bf16 (input row i in column i, zero past m);
 * xsum [groups][16]: each group's sum of hi + lo per input row (affine types; else NULL). */
static void amx_decode_inputs(const float *x, int64_t m, int64_t k, int64_t group, int split,
                              uint32_t *hi, uint32_t *lo, float *xsum) {
    memset(hi, 0, sizeof(uint32_t) * (size_t)(k / 2 * 16));
    if (split) {
        memset(lo, 0, sizeof(uint32_t) * (size_t)(k / 2 * 16));
    }
    if (xsum != NULL) {
        memset(xsum, 0, sizeof(float) * (size_t)(k / group * 16));
    }
    uint16_t *hi16 = (uint16_t *)hi, *lo16 = (uint16_t *)lo;
    for (int64_t i = 0; i < m; ++i) {
        double group_sum = 0.0; /* exact for a group of hi + lo: rounded once, to fp32 */
        for (int64_t j = 0; j < k; ++j) {
            const float v = x[i * k + j];
            const uint16_t h = float_to_bf16(v);
            const uint16_t l = split ? float_to_bf16(v - bf16_to_float(h)) : 0;
            /* Pair j / 2, column i, half j % 2. */
            const int64_t at = (j / 2 * 16 + i) * 2 + j % 2;
            hi16[at] = h;
            if (split) {
                lo16[at] = l;
            }
            if (xsum != NULL) {
                group_sum += (double)bf16_to_float(h) + (double)bf16_to_float(l);
                if ((j + 1) % group == 0) {
                    xsum[j / group * 16 + i] = (float)group_sum;
                    group_sum = 0.0;
                }
            }
        }
    }
}

/* Two groups at a time, each its own tiles: 0, 1 the 16 x 16 fp32 sums; 2, 3 16 weight rows'
 * codes of the group (bf16); 4, 5 the input rows' pairs of it (hi); 6, 7 (lo). */
static void amx_decode_configure(int64_t group) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = t < 4 ? 16 : (uint8_t)(group / 2);
        config.colsb[t] = t == 2 || t == 3 ? (uint16_t)(2 * group) : 64;
    }
    _tile_loadconfig(&config);
}

/* acc[r] += step[r] * C[r] (- offset[r] * xsum, the group's input sums: affine types) for the 16
 * rows of a stored sum tile. */
static inline __attribute__((always_inline)) void amx_decode_scale(__m512 *acc, const float *sums,
                                                                   const float *step,
                                                                   const float *offset,
                                                                   const float *xsum, int affine) {
    const __m512 group_sums = affine ? _mm512_loadu_ps(xsum) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(step[r]), _mm512_load_ps(sums + 16 * r), acc[r]);
        if (affine) {
            acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(offset[r]), group_sums, acc[r]);
        }
    }
}

/* In amx_decode_rows_of: sum tile C = the 16 weight rows' codes of unpacked group g (loaded
 * into tile A) times the input rows' pairs of that group (tile B_HI, and B_LO when split). */
#define AMX_DECODE_DOT(C, A, B_HI, B_LO, g)                                                     \
    do {                                                                                        \
        const int64_t at_ = (group0 + (g)) * (group / 2) * 16;                                  \
        _tile_zero(C);                                                                          \
        _tile_loadd(A, codes + (g) * 16 * group, 2 * group);                                    \
        _tile_loadd(B_HI, hi + at_, 64);                                                        \
        _tile_dpbf16ps(C, A, B_HI);                                                             \
        if (split) {                                                                            \
            _tile_loadd(B_LO, lo + at_, 64);                                                    \
            _tile_dpbf16ps(C, A, B_LO);                                                         \
        }                                                                                       \
    } while (0)

/* acc += sum tile C, stored, scaled by unpacked group g's steps (less offsets). */
#define AMX_DECODE_SCALE(C, g)                                                                  \
    do {                                                                                        \
        _tile_stored(C, sums[C], 64);                                                           \
        amx_decode_scale(acc, sums[C], steps[g], offsets[g],                                    \
                         affine ? xsum + (group0 + (g)) * 16 : NULL, affine);                   \
    } while (0)

/* Blocks unpacked at a time for 16 weight rows: two of a 32-value type (two groups), one of a
 * 256-value type (8 or 16 groups). */
#define AMX_DECODE_VALUES 256

/* y[i * ldy + r] for input rows i < m and the (at most 16) weight rows first <= r < last, from
 * the inputs amx_decode_inputs made. `codes` scratch: [groups][16][group] bf16 for
 * AMX_DECODE_VALUES values. */
static inline __attribute__((always_inline)) void amx_decode_rows_of(
    const block_format f, const int split, const int affine, const uint32_t *hi,
    const uint32_t *lo, const float *xsum, int64_t m, int64_t k, const uint8_t *w,
    int64_t first, int64_t last, float *y, int64_t ldy, uint16_t *codes) {
    const int64_t group = f.group, per_block = f.values / group, row_bytes = k / f.values * f.bytes;
    const int64_t span = f.values == 32 ? 2 : 1; /* blocks unpacked at a time */
    const int64_t rows = last - first;
    float sums[2][256] __attribute__((aligned(64)));
    float steps[BLOCK_MAX_GROUPS][16], offsets[BLOCK_MAX_GROUPS][16];
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
        acc[r] = _mm512_setzero_ps();
    }
    if (rows < 16) { /* the padding rows' codes and steps stay zero */
        memset(codes, 0, sizeof(uint16_t) * (size_t)(16 * AMX_DECODE_VALUES));
        memset(steps, 0, sizeof steps);
        memset(offsets, 0, sizeof offsets);
    }
    const int64_t blocks = k / f.values;
    for (int64_t b0 = 0; b0 < blocks; b0 += span) {
        const int64_t count = b0 + span <= blocks ? span : blocks - b0;
        const int64_t groups = count * per_block;
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < count; ++c) {
                const uint8_t *block = w + (first + r) * row_bytes + (b0 + c) * f.bytes;
                _mm_prefetch((const char *)block + PREFETCH_BYTES, _MM_HINT_T0);
                unpacked_block u;
                const int8_t *q = f.unpack(block, &u);
                for (int64_t j = 0; j < f.values; j += 32) {
                    const int64_t g = c * per_block + j / group;
                    uint16_t pair[32] __attribute__((aligned(64)));
                    codes_to_bf16(q + j, group == 32 ? codes + (g * 16 + r) * 32 : pair);
                    if (group == 16) {
                        memcpy(codes + (g * 16 + r) * 16, pair, 32);
                        memcpy(codes + ((g + 1) * 16 + r) * 16, pair + 16, 32);
                    }
                }
                for (int64_t g = 0; g < per_block; ++g) {
                    steps[c * per_block + g][r] = u.step[g];
                    offsets[c * per_block + g][r] = u.offset[g];
                }
            }
        }
        const int64_t group0 = b0 * per_block; /* the first group's index along k */
        int64_t g = 0;
        for (; g + 1 < groups; g += 2) { /* two groups' tiles in flight */
            AMX_DECODE_DOT(0, 2, 4, 6, g);
            AMX_DECODE_DOT(1, 3, 5, 7, g + 1);
            AMX_DECODE_SCALE(0, g);
            AMX_DECODE_SCALE(1, g + 1);
        }
        if (g < groups) { /* a last block alone of a 32-value type */
            AMX_DECODE_DOT(0, 2, 4, 6, g);
            AMX_DECODE_SCALE(0, g);
        }
    }
    for (int r = 0; r < rows; ++r) {
        _mm512_store_ps(sums[0] + 16 * r, acc[r]);
    }
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t r = 0; r < rows; ++r) {
            y[i * ldy + first + r] = sums[0][16 * r + i];
        }
    }
}

#undef AMX_DECODE_DOT
#undef AMX_DECODE_SCALE

typedef void (*amx_decode_fn)(int, int, const uint32_t *, const uint32_t *, const float *,
                              int64_t, int64_t, const uint8_t *, int64_t, int64_t, float *,
                              int64_t, uint16_t *);
#define AMX_DECODE(NAME, VALUES, BYTES, GROUP)                                                  \
    static void amx_decode_##NAME(int split, int affine, const uint32_t *hi, const uint32_t *lo, \
                                  const float *xsum, int64_t m, int64_t k, const uint8_t *w,    \
                                  int64_t first, int64_t last, float *y, int64_t ldy,           \
                                  uint16_t *codes) {                                            \
        const block_format f = {VALUES, BYTES, GROUP, unpack_##NAME, 0};                        \
        if (split) {                                                                            \
            amx_decode_rows_of(f, 1, affine, hi, lo, xsum, m, k, w, first, last, y, ldy, codes); \
        } else {                                                                                \
            amx_decode_rows_of(f, 0, affine, hi, lo, xsum, m, k, w, first, last, y, ldy, codes); \
        }                                                                                       \
    }
AMX_DECODE(q4_0, 32, 18, 32)
AMX_DECODE(q4_1, 32, 20, 32)
AMX_DECODE(q5_0, 32, 22, 32)
AMX_DECODE(q5_1, 32, 24, 32)
AMX_DECODE(q8_0, 32, 34, 32)
AMX_DECODE(q2_k, 256, 84, 16)
AMX_DECODE(q3_k, 256, 110, 16)
AMX_DECODE(q4_k, 256, 144, 32)
AMX_DECODE(q5_k, 256, 176, 32)
AMX_DECODE(q6_k, 256, 210, 16)

static amx_decode_fn amx_decode_of(int type) {
    switch (type) {
    case GGML_Q4_0: return amx_decode_q4_0;
    case GGML_Q4_1: return amx_decode_q4_1;
    case GGML_Q5_0: return amx_decode_q5_0;
    case GGML_Q5_1: return amx_decode_q5_1;
    case GGML_Q8_0: return amx_decode_q8_0;
    case GGML_Q2_K: return amx_decode_q2_k;
    case GGML_Q3_K: return amx_decode_q3_k;
    case GGML_Q4_K: return amx_decode_q4_k;
    case GGML_Q5_K: return amx_decode_q5_k;
    default: return amx_decode_q6_k;
    }
}

/* hearth_blocks_gemm_amx for m <= MAX_INPUT_ROWS: 16 weight rows a unit of work. */
static int amx_decode(int type, const block_format f, const float *x, int64_t m, int64_t k,
                      const uint8_t *w, int64_t n, float *y, int64_t ldy, int split,
                      int threads) {
    const int64_t group = f.group, groups = k / group;
    const int affine = amx_affine(type);
    const size_t pair_bytes = sizeof(uint32_t) * (size_t)(k / 2 * 16);
    uint8_t *inputs = aligned_alloc(64, 2 * pair_bytes + sizeof(float) * (size_t)(groups * 16));
    if (inputs == NULL) {
        return -1;
    }
    uint32_t *hi = (uint32_t *)inputs, *lo = (uint32_t *)(inputs + pair_bytes);
    float *xsum = affine ? (float *)(inputs + 2 * pair_bytes) : NULL;
    amx_decode_inputs(x, m, k, group, split, hi, lo, xsum);
    const amx_decode_fn rows_fn = amx_decode_of(type);
    const int64_t units = (n + 15) / 16;
#pragma omp parallel num_threads(threads)
    {
        uint16_t codes[16 * AMX_DECODE_VALUES] __attribute__((aligned(64)));
        amx_decode_configure(group);
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < units; ++unit) {
            const int64_t first = unit * 16, last = first + 16 < n ? first + 16 : n;
            rows_fn(split, affine, hi, lo, xsum, m, k, w, first, last, y, ldy, codes);
        }
        _tile_release();
    }
    free(inputs);
    return 0;
}

/* Whether this build and process run hearth_blocks_gemm_amx for GGML type `type`: 1 or 0. */
int hearth_blocks_gemm_amx_takes(int type) {
    block_format f;
    return block_format_of(type, &f) == 0 && (f.group == 16 || f.group == 32) &&
           amx_permission() == 1;
}

/* y[m, n] (row stride ldy) = x [m, k] fp32 @ W^T, W [n, k] the exact values of GGML blocks
 * `w`; x rounded to bf16 (split 0) or split into bf16 hi + lo (split 1). Returns -1 for a type
 * or process without it, or when memory runs out. */
int hearth_blocks_gemm_amx(int type, const float *x, int64_t m, int64_t k, const uint8_t *w,
                           int64_t n, float *y, int64_t ldy, int split, int threads) {
    block_format f;
    if (m < 1 || n < 1 || !hearth_blocks_gemm_amx_takes(type) || block_format_of(type, &f) != 0 ||
        k % f.values != 0) {
        return -1;
    }
    if (m <= MAX_INPUT_ROWS) {
        return amx_decode(type, f, x, m, k, w, n, y, ldy, split, threads);
    }
    const int64_t group = f.group, groups = k / group, padded = (m + 15) / 16 * 16;
    const int affine = amx_affine(type);
    const size_t input_bytes = sizeof(uint16_t) * (size_t)(padded * k * (split ? 2 : 1));
    uint16_t *hi = aligned_alloc(64, (input_bytes + 63) / 64 * 64);
    float *xsum = affine ? malloc(sizeof(float) * (size_t)(padded * groups)) : NULL;
    if (hi == NULL || (affine && xsum == NULL)) {
        free(hi);
        free(xsum);
        return -1;
    }
    uint16_t *lo = split ? hi + padded * k : NULL;
    amx_inputs(x, m, padded, k, group, split, hi, lo, xsum, threads);
    const int64_t chunks = (n + AMX_CHUNK_ROWS - 1) / AMX_CHUNK_ROWS;
    int failed = 0;
    /* Each thread packs its own chunks: a static split by thread, its buffers its own. */
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = chunks * me / team, end = chunks * (me + 1) / team;
        const size_t packed_bytes = sizeof(uint32_t) * (size_t)(4 * (k / 2) * 16);
        const size_t step_bytes = sizeof(float) * (size_t)(groups * AMX_CHUNK_ROWS);
        const size_t work_bytes =
            packed_bytes + 2 * step_bytes + sizeof(uint16_t) * (size_t)(16 * k);
        uint8_t *work = begin < end ? aligned_alloc(64, (work_bytes + 63) / 64 * 64) : NULL;
        if (begin < end && work == NULL) {
            failed = 1;
        } else if (begin < end) {
            uint32_t *packed = (uint32_t *)work;
            float *steps = (float *)(work + packed_bytes);
            float *offsets = steps + groups * AMX_CHUNK_ROWS;
            uint16_t *scratch = (uint16_t *)(offsets + groups * AMX_CHUNK_ROWS);
            amx_configure(group);
            for (int64_t chunk = begin; chunk < end; ++chunk) {
                const int64_t first = chunk * AMX_CHUNK_ROWS;
                const int64_t rows = n - first < AMX_CHUNK_ROWS ? n - first : AMX_CHUNK_ROWS;
                amx_pack_chunk(f, w, k, first, rows, packed, steps, offsets, scratch);
                amx_chunk_rows(hi, lo, xsum, m, padded, k, group, split, affine, packed, steps,
                               offsets, first, rows, y, ldy);
            }
            _tile_release();
            free(work);
        }
    }
    free(hi);
    free(xsum);
    return failed ? -1 : 0;
}
#else
int hearth_blocks_gemm_amx_takes(int type) {
    (void)type;
    return 0;
}

int hearth_blocks_gemm_amx(int type, const float *x, int64_t m, int64_t k, const uint8_t *w,
                           int64_t n, float *y, int64_t ldy, int split, int threads) {
    (void)type, (void)x, (void)m, (void)k, (void)w, (void)n, (void)y, (void)ldy, (void)split;
    (void)threads;
    return -1;
}
#endif
