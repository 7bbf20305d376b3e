/* int4 products in C, for CPUs with AVX-512 BF16 (int4_kernel.py builds this file and calls it;
   dequantize-then-multiply, weight_formats.dequantize_int4, is the reference).

   y (M, N) = x (M, K) W^T, x and y bfloat16, W in groups of 32 inputs: w = q * scale + minimum,
   q in 0..15 (weight_formats.quantize_int4). Per row, output and group:
       y += scale * sum_k x_k q_k + minimum * sum_k x_k
   The first sum by VDPBF16PS, which multiplies bfloat16 pairs and adds them to float32 (q is a
   small integer, exact in bfloat16, so every product is exact); the second once per row and
   group. Why C: torch's _weight_int4pack_mm_for_cpu converts every weight to float32 and works
   through 4 rows at a time, so a tree of 5 to 8 rows reads the weights twice (12.6 ms for the
   default model's blocks at 5 rows against 4.6 at 1, on the 2-core AVX-512 EPYC); here the
   weights are read once for any number of rows, and converted to bfloat16 by one table lookup.

   The same bits for a row whatever rows are multiplied beside it (what keeps greedy Medusa
   lossless): every row goes through the same sequence of operations, in a fixed order (two
   accumulators, even and odd pairs of inputs; the groups in order), only how many rows share
   a pass over the weights changes.
   Layout (int4_kernel.pack): blocks of 16 outputs; per block and group, 16 pairs of inputs
   (k, k + 1) of 16 bytes, byte l = q[16 b + l][k] | q[16 b + l][k + 1] << 4; scales and
   minimums (N / 16, K / 32, 16) float16, as a GGUF's Q4_1 holds them (float32 would add half
   as many bytes again as the 4-bit weights).
   Shapes: M rows, N outputs (a multiple of 16), K inputs (a multiple of 32), G = K / 32 groups. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

enum { ROWS = 8 };  /* rows that share a pass: 2 accumulators each, in registers */

/* bfloat16 of 0..15, twice: VPERMW reads an index's low 5 bits, so bit 4 may be anything */
static const uint16_t BF16_OF[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* 16 bytes of a pair of inputs -> their 32 weights' q as bfloat16, output-major (q[l][k],
   q[l][k + 1] side by side, as VDPBF16PS pairs them): a byte's low nibble goes to the low
   16 bits of its 32, its high nibble to the high 16 (shifted by 12: the index's bits 4..15
   are ignored), then each 16 bits becomes its bfloat16 by table */
static inline __m512bh pair_weights(const uint8_t* bytes, __m512i table) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)bytes));
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table);
}

/* one block of 16 outputs for `n` rows from row m0 (n a constant in each copy the switch below
   makes: the accumulators then live in registers) */
static inline __attribute__((always_inline)) void block_rows(
    const uint16_t* x, const uint8_t* w, const uint16_t* scales, const uint16_t* minimums,
    const float* sums, uint16_t* y, int64_t b, int64_t m0, int64_t N, int64_t K,
    __m512i table, const int n) {
  const int64_t G = K / 32;
  __m512 out[ROWS];
  for (int i = 0; i < n; i++) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++, w += 256) {
    __m512 even[ROWS], odd[ROWS];  /* sum_k x_k q_k over the group's even / odd pairs */
    for (int i = 0; i < n; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (int p = 0; p < 16; p += 2) {
      __m512bh w0 = pair_weights(w + p * 16, table), w1 = pair_weights(w + p * 16 + 16, table);
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
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + g * 16)));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(minimums + g * 16)));
    for (int i = 0; i < n; i++) {
      __m512 q_part = _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), scale);
      __m512 min_part = _mm512_mul_ps(minimum, _mm512_set1_ps(sums[(m0 + i) * G + g]));
      out[i] = _mm512_add_ps(out[i], _mm512_add_ps(q_part, min_part));
    }
  }
  for (int i = 0; i < n; i++) {
    __m256bh o = _mm512_cvtneps_pbh(out[i]);  /* to bfloat16, to nearest even */
    memcpy(y + (m0 + i) * N + b * 16, &o, sizeof o);
  }
}
#endif

/* 1 where this build multiplies (the CPU had AVX-512 BF16 when it was compiled), else 0 */
int int4_available(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return 1;
#else
  return 0;
#endif
}

/* 0 done, 1 not available in this build, 2 out of memory */
int int4_product(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                 const uint16_t* minimums, uint16_t* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const int64_t G = K / 32;
  float* sums = malloc(sizeof(float) * M * G);  /* sum_k x_k per row and group, in order */
  if (sums == NULL) return 2;
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < G; g++) {
      float s = 0.0f;
      for (int k = 0; k < 32; k++) {
        uint32_t bits = (uint32_t)x[m * K + g * 32 + k] << 16;  /* a bfloat16's float */
        float f;
        memcpy(&f, &bits, sizeof f);
        s += f;
      }
      sums[m * G + g] = s;
    }
  const __m512i table = _mm512_loadu_si512(BF16_OF);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < N / 16; b++) {
    const uint8_t* w = packed + b * G * 256;
    const uint16_t *s = scales + b * G * 16, *mn = minimums + b * G * 16;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
      switch (M - m0 < ROWS ? (int)(M - m0) : ROWS) {
#define ROWS_OF(n) case n: block_rows(x, w, s, mn, sums, y, b, m0, N, K, table, n); break;
        ROWS_OF(1) ROWS_OF(2) ROWS_OF(3) ROWS_OF(4) ROWS_OF(5) ROWS_OF(6) ROWS_OF(7) ROWS_OF(8)
#undef ROWS_OF
      }
    }
  }
  free(sums);
  return 0;
#else
  (void)x, (void)packed, (void)scales, (void)minimums, (void)y, (void)M, (void)N, (void)K;
  return 1;
#endif
}
