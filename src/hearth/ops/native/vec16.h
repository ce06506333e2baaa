/* vec16: 16 fp32 lanes, the one vector type kernels.c is written against.
 *
 * With AVX-512 a vec16 is one zmm register; with AVX2 (+ FMA, F16C) it is two ymm halves, and
 * every operation below does the same lane-wise arithmetic on them, so a kernel's sums are
 * formed in the same order on both (only the final horizontal sum may pair lanes differently).
 * `count` arguments say how many of the 16 lanes are real: loads give 0 past them, stores leave
 * memory past them untouched; count >= 16 means all (a tail is the only short case).
 *
 * VEC16_REGISTERS is how many vec16 values fit the register file: kernels size their blocks
 * of independent accumulators by it.
 */
#ifndef HEARTH_VEC16_H
#define HEARTH_VEC16_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

#define VEC16_ISA "avx512"
#define VEC16_REGISTERS 32
typedef __m512 vec16;

static inline __mmask16 vec16_mask(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}
static inline vec16 vec16_zero(void) { return _mm512_setzero_ps(); }
static inline vec16 vec16_set1(float value) { return _mm512_set1_ps(value); }
static inline vec16 vec16_load_f32(const float *p, int64_t count) {
    return _mm512_maskz_loadu_ps(vec16_mask(count), p);
}
/* bf16 -> fp32 is exact: bf16 is fp32's upper half. */
static inline vec16 vec16_load_bf16(const uint16_t *p, int64_t count) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(vec16_mask(count), p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline vec16 vec16_load_i8(const int8_t *p, int64_t count) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(vec16_mask(count), p)));
}
static inline vec16 vec16_fmadd(vec16 a, vec16 b, vec16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec16 vec16_add(vec16 a, vec16 b) { return _mm512_add_ps(a, b); }
static inline vec16 vec16_mul(vec16 a, vec16 b) { return _mm512_mul_ps(a, b); }
static inline vec16 vec16_sub(vec16 a, vec16 b) { return _mm512_sub_ps(a, b); }
static inline vec16 vec16_div(vec16 a, vec16 b) { return _mm512_div_ps(a, b); }
static inline vec16 vec16_max(vec16 a, vec16 b) { return _mm512_max_ps(a, b); }
static inline vec16 vec16_min(vec16 a, vec16 b) { return _mm512_min_ps(a, b); }
static inline vec16 vec16_abs(vec16 a) { return _mm512_abs_ps(a); }
static inline vec16 vec16_round_even(vec16 a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline float vec16_sum(vec16 a) { return _mm512_reduce_add_ps(a); }
static inline float vec16_max_lane(vec16 a) { return _mm512_reduce_max_ps(a); }
static inline void vec16_store_f32(float *p, vec16 a, int64_t count) {
    _mm512_mask_storeu_ps(p, vec16_mask(count), a);
}
/* Rounded to nearest even, as torch's float -> bf16 conversion does; NaN stays a quiet NaN. */
static inline void vec16_store_bf16(uint16_t *p, vec16 a, int64_t count) {
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    const __m512i quiet =
        _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x0040));
    const __m256i narrow = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
    _mm256_mask_storeu_epi16(p, vec16_mask(count), narrow);
}
/* Lanes holding whole numbers in [-128, 127] -> int8. */
static inline void vec16_store_i8(int8_t *p, vec16 a, int64_t count) {
    _mm_mask_storeu_epi8(p, vec16_mask(count), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a)));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#define VEC16_ISA "avx2"
#define VEC16_REGISTERS 8
typedef struct {
    __m256 lo, hi; /* lanes 0-7, 8-15 */
} vec16;

static inline vec16 vec16_pair(__m256 lo, __m256 hi) {
    vec16 v = {lo, hi};
    return v;
}
static inline vec16 vec16_zero(void) {
    return vec16_pair(_mm256_setzero_ps(), _mm256_setzero_ps());
}
static inline vec16 vec16_set1(float value) {
    return vec16_pair(_mm256_set1_ps(value), _mm256_set1_ps(value));
}
static inline vec16 vec16_widen_f32(const float *p) {
    return vec16_pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
}
/* bf16 -> fp32 is exact: bf16 is fp32's upper half. Eight numbers at p: both 128-bit lanes
 * get all eight, and an in-lane byte shuffle puts numbers 0-3 | 4-7 into the upper halves of
 * zeroed 32-bit lanes, avoiding AVX2's lane-crossing widening (vpmovzxwd ymm). */
static inline __m256 vec16_widen_bf16x8(const uint16_t *p) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(
        both, _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                               -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15)));
}
static inline vec16 vec16_widen_bf16(const uint16_t *p) {
    return vec16_pair(vec16_widen_bf16x8(p), vec16_widen_bf16x8(p + 8));
}
/* int8 -> fp32 without AVX2's lane-crossing widening (vpmovsxbd ymm), which limited the int8
 * GEMV to ~4 weights a cycle on an AMD EPYC: both 128-bit lanes get all 16 bytes, an in-lane
 * byte shuffle puts code q (lanes 0-3 | 4-7, then 8-11 | 12-15) into the low byte of a 32-bit
 * lane, and the float with bits 0x4B000000 | (q ^ 0x80) is 2^23 + 128 + q exactly; subtracting
 * 2^23 + 128 leaves q, exactly. */
static inline vec16 vec16_widen_i8(const int8_t *p) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i first = _mm256_shuffle_epi8(
        both, _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                               4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1));
    const __m256i second = _mm256_shuffle_epi8(
        both, _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                               12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1));
    const __m256i magic = _mm256_set1_epi32(0x4B000080);
    const __m256 offset = _mm256_set1_ps(8388736.0f); /* 2^23 + 128 */
    return vec16_pair(_mm256_sub_ps(_mm256_castsi256_ps(_mm256_xor_si256(first, magic)), offset),
                      _mm256_sub_ps(_mm256_castsi256_ps(_mm256_xor_si256(second, magic)), offset));
}
/* The bytes of `count` elements of `size` bytes (none for count <= 0). */
static inline size_t vec16_tail_bytes(int64_t count, int64_t size) {
    return (size_t)((count <= 0 ? 0 : count) * size);
}
/* A tail (only a row's last 16 elements) loads from a zero-padded copy, out of the hot loops'
 * way: AVX2 has no masked loads of 8- or 16-bit elements. `size`: the element's bytes. */
__attribute__((noinline, cold)) static vec16 vec16_load_tail(const void *p, int64_t count,
                                                            int64_t size) {
    _Alignas(32) uint8_t tail[64] = {0};
    memcpy(tail, p, vec16_tail_bytes(count, size));
    if (size == 4) {
        return vec16_widen_f32((const float *)tail);
    }
    if (size == 2) {
        return vec16_widen_bf16((const uint16_t *)tail);
    }
    return vec16_widen_i8((const int8_t *)tail);
}
static inline vec16 vec16_load_f32(const float *p, int64_t count) {
    return __builtin_expect(count < 16, 0) ? vec16_load_tail(p, count, 4) : vec16_widen_f32(p);
}
static inline vec16 vec16_load_bf16(const uint16_t *p, int64_t count) {
    return __builtin_expect(count < 16, 0) ? vec16_load_tail(p, count, 2) : vec16_widen_bf16(p);
}
static inline vec16 vec16_load_i8(const int8_t *p, int64_t count) {
    return __builtin_expect(count < 16, 0) ? vec16_load_tail(p, count, 1) : vec16_widen_i8(p);
}
static inline vec16 vec16_fmadd(vec16 a, vec16 b, vec16 c) {
    return vec16_pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vec16 vec16_add(vec16 a, vec16 b) {
    return vec16_pair(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi));
}
static inline vec16 vec16_mul(vec16 a, vec16 b) {
    return vec16_pair(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi));
}
static inline vec16 vec16_sub(vec16 a, vec16 b) {
    return vec16_pair(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi));
}
static inline vec16 vec16_div(vec16 a, vec16 b) {
    return vec16_pair(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi));
}
static inline vec16 vec16_max(vec16 a, vec16 b) {
    return vec16_pair(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi));
}
static inline vec16 vec16_min(vec16 a, vec16 b) {
    return vec16_pair(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi));
}
static inline vec16 vec16_abs(vec16 a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return vec16_pair(_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi));
}
static inline vec16 vec16_round_even(vec16 a) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return vec16_pair(_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode));
}
/* Pairs lanes as _mm512_reduce_add_ps does: halves, then quarters, then neighbours. */
static inline float vec16_sum(vec16 a) {
    const __m256 eight = _mm256_add_ps(a.lo, a.hi);
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
static inline float vec16_max_lane(vec16 a) {
    const __m256 eight = _mm256_max_ps(a.lo, a.hi);
    const __m128 four = _mm_max_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}
static inline void vec16_store_f32(float *p, vec16 a, int64_t count) {
    if (count < 16) {
        float tail[16];
        _mm256_storeu_ps(tail, a.lo);
        _mm256_storeu_ps(tail + 8, a.hi);
        memcpy(p, tail, vec16_tail_bytes(count, sizeof(float)));
        return;
    }
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
/* 8 lanes' bf16 bit patterns in the low 16 bits of each 32-bit lane: round to nearest even, as
 * torch's float -> bf16 conversion does; NaN stays a quiet NaN. */
static inline __m256i vec16_bf16x8(__m256 a) {
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    /* Both sides are non-negative as signed numbers, so the signed compare is exact. */
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    const __m256i quiet =
        _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x0040));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}
static inline void vec16_store_bf16(uint16_t *p, vec16 a, int64_t count) {
    const __m256i lo = vec16_bf16x8(a.lo), hi = vec16_bf16x8(a.hi);
    /* packus works within 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] before the permute.
     * Every value is below 2^16, so its unsigned saturation never triggers. */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    if (count < 16) {
        uint16_t tail[16];
        _mm256_storeu_si256((__m256i *)tail, packed);
        memcpy(p, tail, vec16_tail_bytes(count, sizeof(uint16_t)));
        return;
    }
    _mm256_storeu_si256((__m256i *)p, packed);
}
/* Lanes holding whole numbers in [-128, 127] -> int8 (the packs saturate nothing then). */
static inline void vec16_store_i8(int8_t *p, vec16 a, int64_t count) {
    const __m256i lo = _mm256_cvtps_epi32(a.lo), hi = _mm256_cvtps_epi32(a.hi);
    const __m128i lo16 =
        _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
    const __m128i hi16 =
        _mm_packs_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    const __m128i bytes = _mm_packs_epi16(lo16, hi16);
    if (count < 16) {
        int8_t tail[16];
        _mm_storeu_si128((__m128i *)tail, bytes);
        memcpy(p, tail, vec16_tail_bytes(count, 1));
        return;
    }
    _mm_storeu_si128((__m128i *)p, bytes);
}

#else
#error "hearth's native kernels need AVX-512, or AVX2 with FMA and F16C (torch's serve others)"
#endif

#endif /* HEARTH_VEC16_H */
