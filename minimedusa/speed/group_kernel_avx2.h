/* group_kernel.c's AVX2 path: float32 rows (and bfloat16 ones where there is no AVX-512 BF16)
   times int4 and int8 weights by FMA, included once by group_kernel.c */
#ifndef MINIMEDUSA_GROUP_KERNEL_AVX2_H
#define MINIMEDUSA_GROUP_KERNEL_AVX2_H
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AVX2_PATH 1
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "group_kernel_store8.h"
#include "kernels_common.h"

/* AVX2 (float32 rows; and bfloat16 ones where the CPU has no bfloat16 dot product: they go to
   float32 once per call), each q to float32 as it is read, and FMA multiplies 8 outputs at a
   time.
   Same layouts, same order per row: one accumulator per 8 outputs, the group's pairs of inputs
   in order. 16 vector registers hold ROWS_F rows' 2 accumulators each, and a pair's weights. */
enum {
  ROWS_F = 4,
  PAIRED = 2,  /* int4 blocks of outputs a one-row pass takes together (group_rows4): the
                  default model's 120 block products at 1 row 10.2 / 8.5 / 10.8 -> 8.6 / 7.5 /
                  9.1 ms in three side-by-side runs, the same bits; 2 rows together were slower
                  (spills), 4 blocks no faster (their tasks split 36 blocks unevenly) */
};

/* int4: one group of nb blocks of 16 outputs (w: the first block's bytes, `stride` bytes to the
   next) for n rows: per quad of inputs k..k+3 32 bytes a block (pack_int4), 16 of them a half of
   the block, their pairs widened to 32 bits: lane o holds output o's q at k in bits 0-3, k + 2 in
   4-7, k + 1 in 8-11 and k + 3 in 12-15. Every output's sum is the same sequence
   of FMAs whatever n and nb (the pairs of inputs in order): nb only puts more independent sums
   in flight where rows are few (one row's 2 sums a block wait on FMA's latency, 4 cycles, not
   on its rate). A quad's nibbles cost 11 operations a 32 weights here, a layout of pairs' 10:
   the default model's 120 block products, float32 rows, at 1 / 2 / 3 / 4 / 8 rows 2.17-2.31 /
   2.75-2.87 / 3.40-3.52 / 4.13-4.22 / 8.24-8.33 ms against pairs' 1.92-2.02 / 2.73-2.87 /
   3.34-3.56 / 3.89-4.09 / 7.76-8.05 (built for AVX2 on the 2-core Zen 5, 3 alternations): int4
   with float32 rows is no default (an AVX2 CPU's is w4a8, with a layout of its own) */
static inline __attribute__((always_inline)) void group_rows4(
    const float* x, const uint8_t* w, int64_t stride, __m256 acc[][2 * PAIRED], int64_t K,
    const int n, const int nb) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int k = 0; k < 32; k += 4, w += 32)
    for (int j = 0; j < nb; j++) {
      const uint8_t* quad = w + j * stride;
      const __m256i d0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)quad));  /* 0-7 */
      const __m256i d1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(quad + 16)));
      for (int e = 0; e < 4; e += 2) {  /* the pairs (k, k + 1) and (k + 2, k + 3) */
        const __m256 k0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d0, 2 * e), low));
        const __m256 k1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d1, 2 * e), low));
        const __m256 l0 = _mm256_cvtepi32_ps(e ? _mm256_srli_epi32(d0, 12)  /* the top nibble */
                                               : _mm256_and_si256(_mm256_srli_epi32(d0, 8), low));
        const __m256 l1 = _mm256_cvtepi32_ps(e ? _mm256_srli_epi32(d1, 12)
                                               : _mm256_and_si256(_mm256_srli_epi32(d1, 8), low));
        for (int i = 0; i < n; i++) {
          const __m256 xk = _mm256_broadcast_ss(x + i * K + k + e);
          const __m256 xl = _mm256_broadcast_ss(x + i * K + k + e + 1);
          acc[i][2 * j] = _mm256_fmadd_ps(xl, l0, _mm256_fmadd_ps(xk, k0, acc[i][2 * j]));
          acc[i][2 * j + 1] = _mm256_fmadd_ps(xl, l1, _mm256_fmadd_ps(xk, k1, acc[i][2 * j + 1]));
        }
      }
    }
}

/* int8: per pair of inputs 32 bytes, output-major (q[o][k], q[o][k + 1], q[o + 1][k], ...):
   8 bytes are 4 outputs x 2 inputs; the rows' (x_k, x_k+1) broadcast as a pair multiply them
   as they lie, and the pairs are added at the group's end (group_sums8) */
static inline __attribute__((always_inline)) void group_rows8(
    const float* x, const uint8_t* w, __m256 acc[][4], int64_t K, const int n) {
  for (int p = 0; p < 16; p++, w += 32) {
    __m256 q[4];
    for (int j = 0; j < 4; j++)
      q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + 8 * j))));
    for (int i = 0; i < n; i++) {
      const __m256 xx = _mm256_castpd_ps(_mm256_broadcast_sd((const double*)(x + i * K + 2 * p)));
      for (int j = 0; j < 4; j++) acc[i][j] = _mm256_fmadd_ps(xx, q[j], acc[i][j]);
    }
  }
}

/* 4 vectors of (4 outputs x 2 inputs) -> 16 outputs' sums, in order, as 2 vectors */
static inline void group_sums8(const __m256 a[4], __m256 s[2]) {
  for (int h = 0; h < 2; h++)  /* hadd gives outputs 0 1 4 5 | 2 3 6 7: put them in order */
    s[h] = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_hadd_ps(a[2 * h], a[2 * h + 1])), 0xD8));
}

/* nb (int4: up to PAIRED; int8: 1) blocks of 16 outputs for `n` rows from row m0 (x and sums
   already from m0; y's first element for them at `at`) */
static inline __attribute__((always_inline)) void float_block_rows(
    const float* x, const uint8_t* w, const uint16_t* scales, const uint16_t* minimums,
    const float* sums, void* y, int64_t at, int64_t N, int64_t K, const int n, const int nb,
    const int bits, const int floats) {
  const int64_t G = K / 32, stride = G * 64 * bits;  /* a block's bytes */
  __m256 out[ROWS_F][2 * PAIRED];
  for (int i = 0; i < n; i++)
    for (int h = 0; h < 2 * nb; h++) out[i][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g++, w += 16 * 4 * bits) {
    for (int j = 0; j < nb; j++) fetch_ahead(w + j * stride, 16 * 4 * bits);
    __m256 s[ROWS_F][2 * PAIRED];
    if (bits == 4) {
      for (int i = 0; i < n; i++)
        for (int h = 0; h < 2 * nb; h++) s[i][h] = _mm256_setzero_ps();
      group_rows4(x + g * 32, w, stride, s, K, n, nb);
    } else {
      __m256 a[ROWS_F][4];
      for (int i = 0; i < n; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm256_setzero_ps();
      group_rows8(x + g * 32, w, a, K, n);
      for (int i = 0; i < n; i++) group_sums8(a[i], s[i]);
    }
    for (int h = 0; h < 2 * nb; h++) {  /* block h / 2's outputs 8 (h % 2) .. 8 (h % 2) + 7 */
      const int64_t at_g = (h / 2) * G * 16 + g * 16 + 8 * (h % 2);
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + at_g)));
      const __m256 minimum = bits == 4 ? _mm256_cvtph_ps(
          _mm_loadu_si128((const __m128i*)(minimums + at_g))) : _mm256_setzero_ps();
      for (int i = 0; i < n; i++) {
        __m256 part = _mm256_mul_ps(s[i][h], scale);
        if (bits == 4) part = _mm256_add_ps(part, _mm256_mul_ps(minimum, _mm256_set1_ps(sums[i * G + g])));
        out[i][h] = _mm256_add_ps(out[i][h], part);
      }
    }
  }
  for (int i = 0; i < n; i++)
    for (int h = 0; h < 2 * nb; h++) store8(y, at + i * N + 8 * h, out[i][h], floats);
}

/* `blocks` (<= PAIRED) blocks of 16 outputs from w for `n` rows: together where int4 has one
   row (more sums in flight), else one by one; the same sums either way */
static inline __attribute__((always_inline)) void float_blocks_rows(
    const float* x, const uint8_t* w, const uint16_t* scales, const uint16_t* minimums,
    const float* sums, void* y, int64_t at, int64_t N, int64_t K, const int n,
    const int64_t blocks, const int bits, const int floats) {
  const int64_t G = K / 32;
  if (bits == 4 && n == 1 && blocks == PAIRED) {
    float_block_rows(x, w, scales, minimums, sums, y, at, N, K, n, PAIRED, bits, floats);
    return;
  }
  for (int64_t j = 0; j < blocks; j++)
    float_block_rows(x, w + j * G * 64 * bits, scales + j * G * 16,
               bits == 4 ? minimums + j * G * 16 : NULL, sums, y, at + j * 16, N, K, n, 1,
               bits, floats);
}

static inline __attribute__((always_inline)) void product_avx2(
    const float* x, const uint8_t* packed, const uint16_t* scales, const uint16_t* minimums,
    const float* sums, void* y, int64_t M, int64_t N, int64_t K, const int bits,
    const int floats) {
  const int64_t G = K / 32, B = N / 16, per_task = bits == 4 ? PAIRED : 1;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < (B + per_task - 1) / per_task; t++) {  /* a task: per_task blocks */
    const int64_t b = t * per_task, blocks = B - b < per_task ? B - b : per_task;
    const uint8_t* w = packed + b * G * 64 * bits;
    const uint16_t *s = scales + b * G * 16, *mn = bits == 4 ? minimums + b * G * 16 : NULL;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_F) {
      const float *xm = x + m0 * K, *sm = bits == 4 ? sums + m0 * G : NULL;
      const int64_t at = m0 * N + b * 16;  /* y's first element for these rows and outputs */
      switch (M - m0 < ROWS_F ? (int)(M - m0) : ROWS_F) {
#define ROWS_OF(n) \
  case n: float_blocks_rows(xm, w, s, mn, sm, y, at, N, K, n, blocks, bits, floats); break;
        ROWS_OF(1) ROWS_OF(2) ROWS_OF(3) ROWS_OF(4)
#undef ROWS_OF
      }
    }
  }
}

/* the rows in float32 (M, K): x itself where `floats`, else a copy of the bfloat16 rows; and
   sum_k x_k per row and group (M, G), in order. One allocation, freed by the caller. */
static float* rows_as_float(const void* x, const int floats, int64_t M, int64_t K,
                            const float** rows, float** sums) {
  float* f = malloc(sizeof(float) * M * ((floats ? 0 : K) + K / 32));
  if (f == NULL) return NULL;
  *sums = f;
  *rows = floats ? (const float*)x : f + M * K / 32;
  for (int64_t i = 0; !floats && i < M * K; i++) {
    uint32_t bits = (uint32_t)((const uint16_t*)x)[i] << 16;
    memcpy(f + M * K / 32 + i, &bits, sizeof(float));
  }
  for (int64_t r = 0; r < M * K / 32; r++) {
    float s = 0.0f;
    for (int k = 0; k < 32; k++) s += (*rows)[r * 32 + k];
    (*sums)[r] = s;
  }
  return f;
}

/* an entry point's work on this path: the rows in float32, then the product of `bits`-bit
   weights; 0 done, 2 out of memory */
static int avx2_entry(const void* x, const int floats, const uint8_t* packed,
                      const uint16_t* scales, const uint16_t* minimums, void* y, int64_t M,
                      int64_t N, int64_t K, const int bits, const int wide) {
  const float* rows;
  float* sums;
  float* f = rows_as_float(x, floats, M, K, &rows, &sums);
  if (f == NULL) return 2;
  if (bits == 4)  /* each a copy with `bits` a constant */
    product_avx2(rows, packed, scales, minimums, sums, y, M, N, K, 4, floats || wide);
  else
    product_avx2(rows, packed, scales, NULL, NULL, y, M, N, K, 8, floats || wide);
  free(f);
  return 0;
}
#endif  /* AVX2_PATH */
#endif
