/* group_kernel.c's AVX-512 BF16 path: bfloat16 rows times int4, int8 and bfloat16 weights by
   VDPBF16PS; its weights' conversion, a group's last step and the store are also the AMX tiles'
   (group_kernel_tiles.h, which includes this file) */
#ifndef MINIMEDUSA_GROUP_KERNEL_BF16_H
#define MINIMEDUSA_GROUP_KERNEL_BF16_H
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_PATH 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels_common.h"

enum { ROWS = 8 };  /* rows that share a pass: 2 accumulators each, in registers */

/* bfloat16 of 0..15, twice: VPERMW reads an index's low 5 bits, so bit 4 may be anything */
static const uint16_t BF16_OF[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* 32 bytes of a quad of inputs -> its 64 weights' q as bfloat16, output-major, two vectors as
   VDPBF16PS pairs them: *first q[l][k], q[l][k + 1] side by side, *next q[l][k + 2], q[l][k + 3].
   Each byte widened to 16 bits becomes its low nibble's bfloat16 by table (VPERMW reads an
   index's low 5 bits, the table's two halves alike), shifted down 4 its high nibble's: 4
   operations a 64 weights, where a layout of pairs (a byte: q[l][k] | q[l][k + 1] << 4) took 8.
   The default model's 120 block products at 1 / 2 / 3 / 4 / 8 rows: 1.11-1.20 / 1.32-1.34 /
   1.56-1.59 / 1.80-1.85 / 2.62-2.72 ms with pairs, 0.98-1.04 / 1.14-1.22 / 1.39-1.45 / 1.61-1.67
   / 2.54-2.62 with quads (a throwaway harness, 4 alternations, the 2-core Zen 5, the weights
   asked for ahead in both; the same bits). The AVX2 path pays for it at 1 row (group_rows4) */
static inline void quad_weights(const uint8_t* bytes, __m512i table, __m512bh* first,
                                __m512bh* next) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)bytes));
  *first = (__m512bh)_mm512_permutexvar_epi16(b, table);
  *next = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
}

/* 32 bytes of a pair of inputs -> their 32 weights' q as bfloat16, output-major: to float32,
   16 at a time, then both halves to bfloat16 (exact: |q| <= 127 needs 8 bits) */
static inline __m512bh pair_weights8(const uint8_t* bytes) {
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)bytes)));
  __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(bytes + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  /* lo's 16 first */
}

/* out + a row's sums over a group (sum_k x_k q_k, 16 outputs) times the group's scales, plus
   (int4) its minimums times the row's sum of x over the group: a group's last step, the same
   for both paths below (minimums and x_sum unread for 8 bits) */
static inline __m512 add_group(__m512 out, __m512 sums, const uint16_t* scales,
                               const uint16_t* minimums, float x_sum, const int bits) {
  if (bits == 16) return _mm512_add_ps(out, sums);  /* bfloat16 weights: no scale, no minimum */
  __m512 q_part = _mm512_mul_ps(sums, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)scales)));
  if (bits == 4) {
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)minimums));
    q_part = _mm512_add_ps(q_part, _mm512_mul_ps(minimum, _mm512_set1_ps(x_sum)));
  }
  return _mm512_add_ps(out, q_part);
}

/* the sum of a group's 32 bfloat16 values, in a fixed order (what keeps a row's bits): its two
   halves added lane by lane, then the 16 lanes by _mm512_reduce_add_ps's fixed tree. A loop of
   32 dependent adds, on one thread before the products, made an 8-row forward of the default
   model 1.01-1.05x slower (6.71 / 7.11 / 7.63 ms against 6.52 / 6.74 / 7.37: the 2-core Zen 5,
   old and new builds in alternate processes) */
static inline float group_sum(const uint16_t* x) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + 16)));
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                            _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16))));
}

/* n rows' 16 outputs of block b into y (M, N): to bfloat16, to nearest even, or as they are
   (float32) where `wide` */
static inline void store_rows(const __m512* out, void* y, int64_t b, int64_t m0, int64_t N, int n,
                              const int wide) {
  for (int i = 0; i < n; i++) {
    if (wide) {
      _mm512_storeu_ps((float*)y + (m0 + i) * N + b * 16, out[i]);
      continue;
    }
    __m256bh o = _mm512_cvtneps_pbh(out[i]);
    memcpy((uint16_t*)y + (m0 + i) * N + b * 16, &o, sizeof o);
  }
}

/* one block of 16 outputs for `n` rows from row m0, weights of `bits` bits (4: with minimums
   and the rows' sums; 8: without; 16: bfloat16 weights, no scales). n and bits are constants
   in each copy the switch below makes: the accumulators then live in registers. */
static inline __attribute__((always_inline)) void block_rows(
    const uint16_t* x, const uint8_t* w, const uint16_t* scales, const uint16_t* minimums,
    const float* sums, void* y, int64_t b, int64_t m0, int64_t N, int64_t K,
    __m512i table, const int n, const int bits, const int wide) {
  const int64_t G = K / 32, pair_bytes = 4 * bits;  /* 16 outputs x 2 inputs x bits / 8 */
  __m512 out[ROWS];
  for (int i = 0; i < n; i++) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++, w += 16 * pair_bytes) {
    fetch_ahead(w, 16 * pair_bytes);
    __m512 even[ROWS], odd[ROWS];  /* sum_k x_k q_k over the group's even / odd pairs */
    for (int i = 0; i < n; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (int p = 0; p < 16; p += 2) {
      const uint8_t* pair = w + p * pair_bytes;  /* int4: the quad of pairs p, p + 1 */
      __m512bh w0, w1;
      if (bits == 16) {  /* bfloat16 weights, stored as VDPBF16PS reads them */
        w0 = (__m512bh)_mm512_loadu_si512(pair);
        w1 = (__m512bh)_mm512_loadu_si512(pair + pair_bytes);
      } else if (bits == 4) {
        quad_weights(pair, table, &w0, &w1);
      } else {
        w0 = pair_weights8(pair);
        w1 = pair_weights8(pair + pair_bytes);
      }
      for (int i = 0; i < n; i++) {
        /* (x_k, x_k+1) of each pair, broadcast straight from memory as VDPBF16PS reads
           them: through a general register (int32_t, then set1) it took 35% longer at 8 rows
           on Zen 4, where moving a register into a vector is slow */
        const uint16_t* xp = x + (m0 + i) * K + g * 32 + 2 * p;
        const __m512bh x0 = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(xp));
        const __m512bh x1 = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(xp + 2));
        even[i] = _mm512_dpbf16_ps(even[i], w0, x0);
        odd[i] = _mm512_dpbf16_ps(odd[i], w1, x1);
      }
    }
    for (int i = 0; i < n; i++)
      out[i] = add_group(out[i], _mm512_add_ps(even[i], odd[i]), scales + g * 16,
                         bits == 4 ? minimums + g * 16 : NULL,
                         bits == 4 ? sums[(m0 + i) * G + g] : 0.0f, bits);
  }
  store_rows(out, y, b, m0, N, n, wide);
}

/* every block of outputs, on OpenMP's threads; every ROWS rows share a pass over the weights
   (inlined into each format's entry point below, so that `bits` is a constant there too) */
static inline __attribute__((always_inline)) void product(
    const uint16_t* x, const uint8_t* packed, const uint16_t* scales, const uint16_t* minimums,
    const float* sums, void* y, int64_t M, int64_t N, int64_t K, const int bits, const int wide) {
  const int64_t G = K / 32;
  const __m512i table = _mm512_loadu_si512(BF16_OF);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < N / 16; b++) {
    const uint8_t* w = packed + b * G * 64 * bits;  /* 16 pairs of pair_bytes a group */
    const uint16_t *s = bits == 16 ? NULL : scales + b * G * 16;
    const uint16_t *mn = bits == 4 ? minimums + b * G * 16 : NULL;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
      switch (M - m0 < ROWS ? (int)(M - m0) : ROWS) {
#define ROWS_OF(n) \
  case n: block_rows(x, w, s, mn, sums, y, b, m0, N, K, table, n, bits, wide); break;
        ROWS_OF(1) ROWS_OF(2) ROWS_OF(3) ROWS_OF(4) ROWS_OF(5) ROWS_OF(6) ROWS_OF(7) ROWS_OF(8)
#undef ROWS_OF
      }
    }
  }
}

#endif  /* BF16_PATH */
#endif
