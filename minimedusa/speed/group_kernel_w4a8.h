/* group_kernel.c's w4a8 path: 8- and 16-bit rows times int4 weights (and the 8-bit LM head) in
   integers, by AVX2 or AVX-VNNI, and AVX-512 VNNI (group_kernel_vnni.h, which includes this
   file for its Rows) */
#ifndef MINIMEDUSA_GROUP_KERNEL_W4A8_H
#define MINIMEDUSA_GROUP_KERNEL_W4A8_H
#if defined(__AVX2__)
#define A8_PATH 1  /* the products of quantized rows: 8-bit (w4a8's first) and 16-bit */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "group_kernel_store8.h"
#include "kernels_common.h"

#if defined(__AVXVNNI__)
/* VPDPBUSD and VPDPWSSD at 256 bits (Intel's client CPUs since Alder Lake, Zen 5), where the
   CPU has no AVX-512 VNNI path (or it is switched off): one instruction where VPMADDUBSW needs
   two or three, the integer sums the same, exact. On the 2-core Zen 5 (w4a8's 120 block
   products in the default model's shapes, random weights held in the caches, builds for
   haswell with and without it in turns): 1.05 / 1.06 / 1.07x faster at 1 / 4 / 8 rows;
   Intel's CPUs unmeasured */
#define AVX_VNNI 1
#endif

/* The w4a8 format: int4 weights times 8-bit activations, as llama.cpp multiplies Q4_1 by Q8_1.
   Each row's group of 32 is quantized first: d = max |x| / 127, a = x / d rounded to nearest,
   in -127..127. Then per row, output and group
       y += scale * d * sum_k q_k a_k  +  minimum * d * sum_k a_k
   with x_k = d a_k in both terms (as llama.cpp's Q8_1 keeps d * sum a): the first sum in
   integers, exact: VPMADDUBSW multiplies 32 pairs of bytes (q unsigned, a signed) and adds
   adjacent products into 16 bits, where the 8 steps of a group stay below 2^15 (16 products
   of at most 15 * 127 = 1,905: 30,480). On the 2-core AVX2 EPYC a row costs a
   fraction of the FMAs' float products (bench --profile); what it costs in quality is
   format_quality's to say. A row's bits do not depend on the rows beside it: the integer sums
   are exact, and the float terms come in a fixed order per row. */
enum { ROWS_Q = 4 };  /* rows that share a pass over a block's weights (8- and 16-bit rows) */

/* the rows' groups quantized: a8 (M, K) int8 or a16 (M, K) int16 (the other NULL), d and
   d * sum a (M, G) float32 */
typedef struct { int8_t* a8; int16_t* a16; float* d; float* sums; } Rows;

/* the 8 lanes of v added (or their maximum taken), in a fixed order */
static inline float lanes_sum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline float lanes_max(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* group g of the rows (32 values) as float32 in v, a bfloat16 row's 16 bits on top; returns the
   group's largest |x| */
static inline float load_group(const void* x, const int floats, int64_t g, __m256 v[4]) {
  const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int j = 0; j < 4; j++)
    v[j] = floats ? _mm256_loadu_ps((const float*)x + g * 32 + 8 * j)
                  : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                        (const __m128i*)((const uint16_t*)x + g * 32 + 8 * j))), 16));
  return lanes_max(_mm256_max_ps(
      _mm256_max_ps(_mm256_and_ps(no_sign, v[0]), _mm256_and_ps(no_sign, v[1])),
      _mm256_max_ps(_mm256_and_ps(no_sign, v[2]), _mm256_and_ps(no_sign, v[3]))));
}

/* v's 32 values times `inverse`, to the nearest integer (even on a tie), as int32 */
static inline void round_group(const __m256 v[4], float inverse, __m256i a[4]) {
  for (int j = 0; j < 4; j++)
    a[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(inverse)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* d * the sum of a group's 32 integers a (4 vectors of 8): the lanes' sums are exact in float32
   (|sum| <= 32 x 32767 < 2^24) */
static inline float scaled_sum(float d, const __m256i a[4]) {
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(a[0], a[1]),
                                       _mm256_add_epi32(a[2], a[3]));
  return d * lanes_sum(_mm256_cvtepi32_ps(sum));
}

static int rows_as_int8(const void* x, const int floats, int64_t M, int64_t K, Rows* r) {
  const int64_t groups = M * K / 32;
  float* f = malloc(sizeof(float) * 2 * groups + M * K);
  if (f == NULL) return 0;
  r->d = f, r->sums = f + groups, r->a8 = (int8_t*)(f + 2 * groups), r->a16 = NULL;
  for (int64_t g = 0; g < groups; g++) {
    __m256 v[4];
    const float d = load_group(x, floats, g, v) / 127.0f;
    __m256i a[4];  /* |a| <= 127 */
    round_group(v, d > 0.0f ? 1.0f / d : 0.0f, a);
    /* 32 int32 -> 32 int8: the packs interleave the 128-bit lanes; a permutation restores
       the order */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]),
                                              _mm256_packs_epi32(a[2], a[3]));
    _mm256_storeu_si256((__m256i*)(r->a8 + g * 32), _mm256_permutevar8x32_epi32(
        packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    /* the minimum's term multiplies the quantized activations too, d * sum a, not the exact
       sum of x: w = q * scale + minimum, so the error of q's term alone (sum q * scale * (a d
       - x), q * scale up to 15 scales) cancels against the minimum's only when both see the
       same activations. With the exact sum, top-1 agreement with float32 fell to 94.8%
       (KL 0.0137, format_quality), against 97.8% (0.0022) with the activations alike */
    r->d[g] = d;
    r->sums[g] = scaled_sum(d, a);
  }
  return 1;
}

/* w4a8's own layout (group_kernel.pack_int4_a8), per block of 16 outputs and chunk of 8 inputs
   k..k+7: 64 bytes, 32 a half of the block (outputs 8h..8h+7), whose byte 4o + j holds output
   o's q at input k + j (low nibble) and k + 4 + j (high nibble), j = 0..3. Masked, the low
   nibbles are 8 outputs x 4 inputs side by side as VPMADDUBSW pairs them, and the high ones
   shifted down the next 4 inputs: 3 operations a 64 weights, where the int4 layout needed 9
   shuffles (the default model's 120 block products at 1 / 8 / 16 rows took 1.09-1.19x /
   1.07x / 1.08-1.12x as long that way, side by side on the 2-core AVX2 EPYC). One block of
   16 outputs for `n` rows (a, d and sums from the block's first row; y's first element for
   them at `at`) */
static inline __attribute__((always_inline)) void block_rows8(
    const Rows* r, const uint8_t* w, const uint16_t* scales, const uint16_t* minimums,
    void* y, int64_t at, int64_t N, int64_t K, const int n, const int floats) {
  const int64_t G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  __m256 out[ROWS_Q][2];
  for (int i = 0; i < n; i++) out[i][0] = out[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    fetch_ahead(w, 256);
    __m256i acc[ROWS_Q][2];  /* per output, two 16-bit sums of the group's products */
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    /* not unrolled: unrolled, gcc 12 computed all 32 of a group's VPMADDUBSW first and
       spilled them to the stack (the default model's 90 w4a8 products at 4 / 8 / 16 rows took
       1.15 / 1.19 / 1.19x as long so, side by side on the 2-core AVX2 EPYC; the same bits) */
#pragma GCC unroll 1
    for (int c = 0; c < 4; c++, w += 64)
      for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 32 * h));
        const __m256i first = _mm256_and_si256(v, low);  /* inputs k..k+3 of 8 outputs */
        const __m256i next = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);  /* k+4..k+7 */
        for (int i = 0; i < n; i++) {
          const int8_t* a = r->a8 + i * K + g * 32 + 8 * c;
          const __m256i a0 = _mm256_broadcastd_epi32(_mm_loadu_si32(a));
          const __m256i a1 = _mm256_broadcastd_epi32(_mm_loadu_si32(a + 4));
#if defined(AVX_VNNI)
          acc[i][h] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc[i][h], first, a0),
                                              next, a1);
#else
          acc[i][h] = _mm256_add_epi16(acc[i][h], _mm256_add_epi16(
              _mm256_maddubs_epi16(first, a0), _mm256_maddubs_epi16(next, a1)));
#endif
        }
      }
    for (int h = 0; h < 2; h++) {
      const int64_t at_g = g * 16 + 8 * h;  /* the group's scales of these 8 outputs */
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + at_g)));
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(minimums + at_g)));
      for (int i = 0; i < n; i++) {
#if defined(AVX_VNNI)
        const __m256 qa = _mm256_cvtepi32_ps(acc[i][h]);  /* VPDPBUSD's sums: 32 bits */
        (void)ones;
#else
        const __m256 qa = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[i][h], ones));
#endif
        out[i][h] = _mm256_fmadd_ps(qa, _mm256_mul_ps(scale, _mm256_set1_ps(r->d[i * G + g])),
                                    out[i][h]);
        out[i][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(r->sums[i * G + g]), out[i][h]);
      }
    }
  }
  for (int i = 0; i < n; i++)
    for (int h = 0; h < 2; h++) store8(y, at + i * N + 8 * h, out[i][h], floats);
}

/* 16-bit activations (int4_a16_product): the same weights in w4a8's layout times each row's groups
   of 32 quantized to 16 bits, d = max |x| / 32767 (within 1.5e-5 of the group's largest value: far
   below float32 -> bfloat16's 2^-9), as VPMADDWD multiplies them: pairs of 16-bit integers added
   into 32 bits, exact. Why: at 1-2 rows a float32 product is bound by turning each 4-bit q into a
   float (12 operations a 32 weights, shared by the rows) where VPMADDWD needs 7 a 64; on the 2-core
   AVX2 EPYC, 30 layers' wqkv and down at 1 / 2 / 3 / 4 / 8 rows took 1.76-1.90 / 1.92-2.12 /
   2.56-2.59 / 3.32-3.39 / 6.33-6.49 ms against the float32 FMAs' 2.31-2.38 / 2.83-2.90 / 3.14-3.31
   / 3.54-3.73 / 6.90-7.04 (a throwaway harness, both paths alternating in one process): a row or
   two cost less, more rows about the same. Per row and group, as w4a8: y += scale * d * sum_k q_k
   a_k + minimum * d * sum_k a_k. The layout's 32-bit words hold, as 16-bit halves, output o's q at
   inputs (k, k + 2) in nibble 0, (k + 4, k + 6) in 1, (k + 1, k + 3) in 2 and (k + 5, k + 7) in 3:
   so each chunk of 8 activations is stored as a_k a_k+2 a_k+4 a_k+6 a_k+1 a_k+3 a_k+5 a_k+7, the
   pairs VPMADDWD meets there. */

/* the rows' groups quantized to 16 bits (a16 in that order, or in their own: `natural`, for the
   int8 layout's pairs of inputs, int8_a16_product) */
static int rows_as_int16(const void* x, const int floats, int64_t M, int64_t K, Rows* r,
                         const int natural) {
  static const int PLACE[8] = {0, 4, 1, 5, 2, 6, 3, 7};  /* input k + j's place in its chunk */
  static const int SAME[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const int* place = natural ? SAME : PLACE;
  const int64_t groups = M * K / 32;
  float* f = malloc(sizeof(float) * 2 * groups + sizeof(int16_t) * M * K);
  if (f == NULL) return 0;
  r->d = f, r->sums = f + groups, r->a16 = (int16_t*)(f + 2 * groups), r->a8 = NULL;
  for (int64_t g = 0; g < groups; g++) {
    __m256 v[4];
    const float d = load_group(x, floats, g, v) / 32767.0f;
    __m256i a[4];  /* |a| <= 32767; vector j: the group's chunk j */
    round_group(v, d > 0.0f ? 1.0f / d : 0.0f, a);
    int32_t lanes[8];
    for (int j = 0; j < 4; j++) {
      _mm256_storeu_si256((__m256i*)lanes, a[j]);
      for (int i = 0; i < 8; i++) r->a16[g * 32 + 8 * j + place[i]] = (int16_t)lanes[i];
    }
    r->d[g] = d;
    r->sums[g] = scaled_sum(d, a);
  }
  return 1;
}

/* one block of 16 outputs for `n` rows, as block_rows8: per chunk and half, the 4 nibbles of
   each 16 bits masked down are 4 vectors of (q, q) pairs for 8 outputs, each met by a
   broadcast pair of the row's activations; a group's sums stay in 32 bits (16 x 2 x 15 x
   32767 < 2^24) */
static inline __attribute__((always_inline)) void block_rows16(
    const Rows* r, const uint8_t* w, const uint16_t* scales, const uint16_t* minimums,
    void* y, int64_t at, int64_t N, int64_t K, const int n, const int floats) {
  const int64_t G = K / 32;
  const __m256i low = _mm256_set1_epi16(0x0F);
  __m256 out[ROWS_Q][2];
  for (int i = 0; i < n; i++) out[i][0] = out[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    fetch_ahead(w, 256);
    __m256i acc[ROWS_Q][2];  /* per output, the group's sum of q a */
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int c = 0; c < 4; c++, w += 64)
      for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 32 * h));
        const __m256i q[4] = {_mm256_and_si256(v, low),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(v, 8), low),
                              _mm256_srli_epi16(v, 12)};
        for (int i = 0; i < n; i++) {
          const int16_t* a = r->a16 + i * K + g * 32 + 8 * c;
#if defined(AVX_VNNI)
          for (int j = 0; j < 4; j++)
            acc[i][h] = _mm256_dpwssd_avx_epi32(
                acc[i][h], q[j], _mm256_broadcastd_epi32(_mm_loadu_si32(a + 2 * j)));
#else
          __m256i pairs[4];
          for (int j = 0; j < 4; j++) {
            int32_t pair;
            memcpy(&pair, a + 2 * j, sizeof pair);
            pairs[j] = _mm256_madd_epi16(q[j], _mm256_set1_epi32(pair));
          }
          acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_add_epi32(
              _mm256_add_epi32(pairs[0], pairs[1]), _mm256_add_epi32(pairs[2], pairs[3])));
#endif
        }
      }
    for (int h = 0; h < 2; h++) {
      const int64_t at_g = g * 16 + 8 * h;
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + at_g)));
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(minimums + at_g)));
      for (int i = 0; i < n; i++) {
        out[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]),
                                    _mm256_mul_ps(scale, _mm256_set1_ps(r->d[i * G + g])),
                                    out[i][h]);
        out[i][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(r->sums[i * G + g]), out[i][h]);
      }
    }
  }
  for (int i = 0; i < n; i++)
    for (int h = 0; h < 2; h++) store8(y, at + i * N + 8 * h, out[i][h], floats);
}

/* The int8 layout (an LM head's 8-bit groups) times 16-bit activations (int8_a16_product): its
   32 bytes a pair of inputs are 16 outputs' (q_k, q_k+1), so 16 of them sign-extended to 16 bits
   are 8 outputs' pairs as VPMADDWD multiplies them, met by the row's (a_k, a_k+1) in their own
   order. Per row, output and group: y += scale * d * sum_k q_k a_k, the sum exact in 32 bits
   (32 x 127 x 32767 < 2^31). On the 2-core AVX2 EPYC, the default model's LM head (49,152 x
   576) at 1 / 2 / 3 / 4 / 8 rows: 1.76-1.89 / 1.75-1.84 / 1.90-2.09 / 2.28-2.46 / 4.48-4.55 ms
   against float32 rows' 1.75-2.07 / 1.93-2.13 / 2.61-2.66 / 2.69-2.96 / 5.58-5.96 (a throwaway
   harness, both alternating): a tree's rows cost less, one row the same (memory-bound). One
   block of 16 outputs for `n` rows, as block_rows16. */
static inline __attribute__((always_inline)) void block_rows16_int8(
    const Rows* r, const uint8_t* w, const uint16_t* scales, void* y, int64_t at, int64_t N,
    int64_t K, const int n, const int floats) {
  const int64_t G = K / 32;
  __m256 out[ROWS_Q][2];
  for (int i = 0; i < n; i++) out[i][0] = out[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    fetch_ahead(w, 512);
    __m256i acc[ROWS_Q][2];  /* per output, the group's sum of q a */
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (int p = 0; p < 16; p++, w += 32)  /* inputs k = 32 g + 2 p and k + 1 */
      for (int h = 0; h < 2; h++) {  /* outputs 8 h .. 8 h + 7 */
        const __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 16 * h)));
        for (int i = 0; i < n; i++) {
          int32_t pair;
          memcpy(&pair, r->a16 + i * K + g * 32 + 2 * p, sizeof pair);
          acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(q, _mm256_set1_epi32(pair)));
        }
      }
    for (int h = 0; h < 2; h++) {
      const __m256 scale = _mm256_cvtph_ps(
          _mm_loadu_si128((const __m128i*)(scales + g * 16 + 8 * h)));
      for (int i = 0; i < n; i++)
        out[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]),
                                    _mm256_mul_ps(scale, _mm256_set1_ps(r->d[i * G + g])),
                                    out[i][h]);
    }
  }
  for (int i = 0; i < n; i++)
    for (int h = 0; h < 2; h++) store8(y, at + i * N + 8 * h, out[i][h], floats);
}
#endif  /* A8_PATH */
#endif
