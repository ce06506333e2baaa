/* Weight-only int8 matrix-vector product for CPU decode (AVX-512).
 *
 * y[m, n] = bf16(s[n] * sum_k x[m, k] * q[n, k]) with x in bf16, q in int8, one bf16 scale per
 * weight row, and fp32 products and sums. Decode reads every weight once per token, so the
 * kernel exists to run at memory bandwidth: each thread walks one contiguous range of rows,
 * four rows at a time, and each 16 weights are widened to fp32 once for all input rows.
 *
 * Why not torch's aten._weight_int8pack_mm: on short rows (the 262144 x 640 head of Gemma 3
 * 270M) the hardware prefetcher does not keep up and it streams at half the bandwidth; the
 * software prefetch below doubles that (benchmarks/results/cpu_int8_gemv-2026-12-04.md).
 *
 * Built on first use by hearth/quant/native.py (-O3 -march=native -fopenmp). OpenMP is then
 * served by the libgomp that torch has loaded already, so both share one thread pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef __AVX512F__
#error "hearth's native kernels need AVX-512; torch's own kernels serve other CPUs"
#endif

/* Weight rows per step: they share each load of x. */
#define ROWS 4
/* Input rows per step: 4 x 4 accumulators plus 4 widened weights fit the 32 registers. */
#define INPUT_ROWS 4
/* More input rows than this is a prefill, which runs as a dense GEMM instead. */
#define MAX_INPUT_ROWS 16
/* How far ahead of the loads the weight stream is prefetched, in bytes (measured best of
 * 4 KiB .. 32 KiB on the head; the exact value matters little past ~8 KiB). */
#define PREFETCH_BYTES 16384

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

/* 16 int8 weights from q[j], widened to fp32 (exact); masked for the tail of a row. */
static inline __m512 load_weights(const int8_t *q, int64_t j, __mmask16 mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q + j)));
}

/* out[i][r] = x[i] . q[r] for input rows i < m (1..INPUT_ROWS) and the ROWS weight rows
 * q[r] = q + r * k. The block's ROWS * k bytes are consumed 64 bytes per step of j, so one
 * prefetch per step covers the stream PREFETCH_BYTES ahead (prefetches never fault). */
static void dot_rows(const float *x, int64_t m, const int8_t *q, int64_t k,
                     float out[INPUT_ROWS][ROWS]) {
    __m512 acc[INPUT_ROWS][ROWS];
    for (int i = 0; i < INPUT_ROWS; ++i) {
        for (int r = 0; r < ROWS; ++r) {
            acc[i][r] = _mm512_setzero_ps();
        }
    }
    for (int64_t j = 0; j < k; j += 16) {
        _mm_prefetch((const char *)(q + PREFETCH_BYTES + j * ROWS), _MM_HINT_T0);
        const __mmask16 mask = k - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - j)) - 1);
        const __m512 w0 = load_weights(q, j, mask);
        const __m512 w1 = load_weights(q + k, j, mask);
        const __m512 w2 = load_weights(q + 2 * k, j, mask);
        const __m512 w3 = load_weights(q + 3 * k, j, mask);
        if (m == 1) { /* decode: a branch the compiler keeps all accumulators in registers for */
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + j);
            acc[0][0] = _mm512_fmadd_ps(xv, w0, acc[0][0]);
            acc[0][1] = _mm512_fmadd_ps(xv, w1, acc[0][1]);
            acc[0][2] = _mm512_fmadd_ps(xv, w2, acc[0][2]);
            acc[0][3] = _mm512_fmadd_ps(xv, w3, acc[0][3]);
            continue;
        }
        for (int64_t i = 0; i < m; ++i) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * k + j);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);
        }
    }
    for (int64_t i = 0; i < m; ++i) {
        for (int r = 0; r < ROWS; ++r) {
            out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
        }
    }
}

/* y [m, n] = x [m, k] @ (q [n, k] * scales [n])^T on `threads` OpenMP threads.
 * Returns 0, or -1 when m is outside 1..MAX_INPUT_ROWS or memory runs out. */
int hearth_int8_rows_matmul(const uint16_t *x, int64_t m, int64_t k, const int8_t *q,
                            const uint16_t *scales, int64_t n, uint16_t *y, int threads) {
    if (m < 1 || m > MAX_INPUT_ROWS || k < 1 || n < 1) {
        return -1;
    }
    /* x once in fp32; the last block's missing weight rows read a zeroed copy. */
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    int8_t *last = calloc((size_t)(ROWS * k), 1);
    if (xf == NULL || last == NULL) {
        free(xf);
        free(last);
        return -1;
    }
    for (int64_t i = 0; i < m * k; ++i) {
        xf[i] = bf16_to_float(x[i]);
    }
    const int64_t blocks = (n + ROWS - 1) / ROWS;
    const int64_t tail_rows = n - (blocks - 1) * ROWS;
    memcpy(last, q + (blocks - 1) * ROWS * k, (size_t)(tail_rows * k));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t block = 0; block < blocks; ++block) {
        const int64_t first = block * ROWS;
        const int64_t rows = block == blocks - 1 ? tail_rows : ROWS;
        const int8_t *weights = block == blocks - 1 ? last : q + first * k;
        float sums[INPUT_ROWS][ROWS];
        for (int64_t i0 = 0; i0 < m; i0 += INPUT_ROWS) {
            const int64_t chunk = m - i0 < INPUT_ROWS ? m - i0 : INPUT_ROWS;
            dot_rows(xf + i0 * k, chunk, weights, k, sums);
            for (int64_t i = 0; i < chunk; ++i) {
                for (int64_t r = 0; r < rows; ++r) {
                    const float scale = bf16_to_float(scales[first + r]);
                    y[(i0 + i) * n + first + r] = float_to_bf16(sums[i][r] * scale);
                }
            }
        }
    }
    free(xf);
    free(last);
    return 0;
}
