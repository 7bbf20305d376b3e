/* group_kernel.c's AVX-512 VNNI code for w4a8, inside its w4a8 path: the same rows
   (group_kernel_w4a8.h's Rows), stored as its AVX2 code stores them (store8) */
#ifndef MINIMEDUSA_GROUP_KERNEL_VNNI_H
#define MINIMEDUSA_GROUP_KERNEL_VNNI_H
#include "group_kernel_w4a8.h"

#if defined(A8_PATH) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define VNNI_PATH 1
#include <immintrin.h>
#include <stdint.h>

#include "group_kernel_store8.h"
#include "kernels_common.h"

/* AVX-512 VNNI (Zen 4 and 5, Intel since Ice Lake): the same three products, 16 outputs a
   vector. VPDPBUSD multiplies 4 pairs of bytes (q unsigned, a signed) in each 32-bit lane and
   adds them to it, VPDPWSSD 2 pairs of 16-bit integers: each replaces two or three of the AVX2
   code's instructions, at twice its width. The group's integer sums are exact either way and
   each output's float steps are the AVX2 code's, in its order, so a row's bits are the same on
   both paths (tested): what format_quality measured of w4a8 holds here. */
enum { ROWS_V = 8 };  /* rows a pass: a group's sums and the outputs, 16 of the 32 registers */

/* 16 sums stored as the caller's rows are, as store8 stores them */
static inline void store16(void* y, int64_t at, __m512 v, const int floats) {
  store8(y, at, _mm512_castps512_ps256(v), floats);
  store8(y, at + 8, _mm512_extractf32x8_ps(v, 1), floats);
}

/* 4 bytes (or 2 16-bit integers) of a row, in every 32-bit lane */
static inline __m512i broadcast4(const void* a) {
  return _mm512_broadcastd_epi32(_mm_loadu_si32(a));
}

/* a group's last step for 16 outputs, as block_rows8's and block_rows16's: out + the integer
   sums times scale * d, then + minimum * d * sum a (int4; minimums NULL for int8) */
static inline __m512 add_group_q(__m512 out, __m512i sums, const uint16_t* scales,
                                 const uint16_t* minimums, float d, float d_sum) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)scales));
  out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_set1_ps(d)), out);
  if (minimums == NULL) return out;
  const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)minimums));
  return _mm512_fmadd_ps(minimum, _mm512_set1_ps(d_sum), out);
}

/* block_rows8 by VPDPBUSD: a chunk's 64 bytes are the block's 16 outputs x 4 bytes, one vector;
   its low nibbles meet inputs k..k+3, its high ones k+4..k+7 */
static inline __attribute__((always_inline)) void block_rows8_vnni(
    const Rows* r, const uint8_t* w, const uint16_t* scales, const uint16_t* minimums,
    void* y, int64_t at, int64_t N, int64_t K, const int n, const int floats) {
  const int64_t G = K / 32;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 out[ROWS_V];
  for (int i = 0; i < n; i++) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    fetch_ahead(w, 256);
    __m512i acc[ROWS_V];  /* per output, the group's sum of q a */
    for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++, w += 64) {
      const __m512i v = _mm512_loadu_si512(w);
      const __m512i first = _mm512_and_si512(v, low);
      const __m512i next = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int i = 0; i < n; i++) {
        const int8_t* a = r->a8 + i * K + g * 32 + 8 * c;
        acc[i] = _mm512_dpbusd_epi32(acc[i], first, broadcast4(a));
        acc[i] = _mm512_dpbusd_epi32(acc[i], next, broadcast4(a + 4));
      }
    }
    for (int i = 0; i < n; i++)
      out[i] = add_group_q(out[i], acc[i], scales + g * 16, minimums + g * 16, r->d[i * G + g],
                           r->sums[i * G + g]);
  }
  for (int i = 0; i < n; i++) store16(y, at + i * N, out[i], floats);
}

/* block_rows16 by VPDPWSSD: the chunk's 4 nibbles of each 16 bits masked down, each met by its
   pair of the row's activations. Not one function with block_rows8_vnni (a constant row_bits
   choosing the chunk's step): so, w4a8's block products at 8 and 16 rows took 1.09x and 1.12x
   as long (each against int4's beside it, the 2-core Zen 5) */
static inline __attribute__((always_inline)) void block_rows16_vnni(
    const Rows* r, const uint8_t* w, const uint16_t* scales, const uint16_t* minimums,
    void* y, int64_t at, int64_t N, int64_t K, const int n, const int floats) {
  const int64_t G = K / 32;
  const __m512i low = _mm512_set1_epi16(0x0F);
  __m512 out[ROWS_V];
  for (int i = 0; i < n; i++) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    fetch_ahead(w, 256);
    __m512i acc[ROWS_V];
    for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++, w += 64) {
      const __m512i v = _mm512_loadu_si512(w);
      const __m512i q[4] = {_mm512_and_si512(v, low),
                            _mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                            _mm512_and_si512(_mm512_srli_epi16(v, 8), low),
                            _mm512_srli_epi16(v, 12)};
      for (int i = 0; i < n; i++) {
        const int16_t* a = r->a16 + i * K + g * 32 + 8 * c;
        for (int j = 0; j < 4; j++)
          acc[i] = _mm512_dpwssd_epi32(acc[i], q[j], broadcast4(a + 2 * j));
      }
    }
    for (int i = 0; i < n; i++)
      out[i] = add_group_q(out[i], acc[i], scales + g * 16, minimums + g * 16, r->d[i * G + g],
                           r->sums[i * G + g]);
  }
  for (int i = 0; i < n; i++) store16(y, at + i * N, out[i], floats);
}

/* block_rows16_int8 by VPDPWSSD: a pair of inputs' 32 bytes sign-extended are the 16 outputs'
   (q_k, q_k+1), one vector */
static inline __attribute__((always_inline)) void block_rows16_int8_vnni(
    const Rows* r, const uint8_t* w, const uint16_t* scales, void* y, int64_t at, int64_t N,
    int64_t K, const int n, const int floats) {
  const int64_t G = K / 32;
  __m512 out[ROWS_V];
  for (int i = 0; i < n; i++) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    fetch_ahead(w, 512);
    __m512i acc[ROWS_V];
    for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_si512();
    for (int p = 0; p < 16; p++, w += 32) {  /* inputs k = 32 g + 2 p and k + 1 */
      const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)w));
      for (int i = 0; i < n; i++)
        acc[i] = _mm512_dpwssd_epi32(acc[i], q, broadcast4(r->a16 + i * K + g * 32 + 2 * p));
    }
    for (int i = 0; i < n; i++)
      out[i] = add_group_q(out[i], acc[i], scales + g * 16, NULL, r->d[i * G + g], 0.0f);
  }
  for (int i = 0; i < n; i++) store16(y, at + i * N, out[i], floats);
}

static int vnni = 1;  /* whether this process uses them: group_kernel_vnni */
#endif  /* VNNI_PATH */
#endif
