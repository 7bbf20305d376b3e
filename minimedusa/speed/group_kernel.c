/* Products of weights quantized in groups of 32 inputs, in C: bfloat16 rows on CPUs with
   AVX-512 BF16 (on AMX tiles where the CPU has them); float32 rows, and bfloat16 ones where
   there is no AVX-512 BF16, on CPUs with AVX2, FMA and F16C (the second part of the file: a
   build for AVX-512 has both); and (the third part) w4a8's quantized rows, by AVX2 or, where
   the CPU has it, AVX-512 VNNI (group_kernel.py builds this file and calls it;
   dequantize-then-multiply is the reference: quantized.dequantize_int4 and
   dequantize_int8_groups).

   y (M, N) = x (M, K) W^T, x and y bfloat16, W in groups of 32 inputs, two formats (the GGUF's):
       int4 (Q4_1): w = q * scale + minimum, q in 0..15     (the blocks' weights)
       int8 (Q8_0): w = q * scale,           q in -127..127 (the LM head)
   Per row, output and group:
       y += scale * sum_k x_k q_k  (+ minimum * sum_k x_k, int4)
   The first sum by VDPBF16PS, which multiplies bfloat16 pairs and adds them to float32 (q is a
   small integer, exact in bfloat16, so every product is exact); the second once per row and
   group. Why C: torch's _weight_int4pack_mm_for_cpu converts every weight to float32 and works
   through 4 rows at a time, so a tree of 5 to 8 rows reads the weights twice (12.6 ms for the
   default model's blocks at 5 rows against 4.6 at 1, on the 2-core AVX-512 EPYC); here the
   weights are read once for any number of rows. And the LM head, 21% of the default model's
   weights, in 8 bits reads half of what bfloat16 does, and is the file's own, to the bit.

   The same bits for a row whatever rows are multiplied beside it (what keeps greedy Medusa
   lossless): every row goes through the same sequence of operations, in a fixed order (two
   accumulators, even and odd pairs of inputs; the groups in order), only how many rows share
   a pass over the weights changes.
   Layout (group_kernel.pack_int4 and pack_int8): blocks of 16 outputs; per block and group,
   int4: 8 quads of inputs k..k+3, 32 bytes a quad, byte 2 l + j = q[16 b + l][k + j] |
   q[16 b + l][k + 2 + j] << 4 (j = 0, 1): widened to 16 bits, the low nibbles are the pairs
   (k, k + 1) of the 16 outputs side by side, the high ones the pairs (k + 2, k + 3); int8: 16
   pairs of inputs (k, k + 1), 32 bytes a pair, q[16 b][k], q[16 b][k + 1], q[16 b + 1][k], ...
   (w4a8 has a layout of its own, pack_int4_a8: below.)
   Scales and minimums (N / 16, K / 32, 16) float16, as the GGUF holds them (float32 would add
   half as many bytes again as the 4-bit weights).
   Shapes: M rows, N outputs (a multiple of 16), K inputs (a multiple of 32), G = K / 32 groups. */
#include <stdint.h>
#include <stdlib.h>

/* each CPU path, in its own file: its code compiled where this build has its instructions */
#include "group_kernel_bf16.h"
#include "group_kernel_tiles.h"
#include "group_kernel_avx2.h"
#include "group_kernel_w4a8.h"
#include "group_kernel_vnni.h"

/* 1 where this build multiplies (the CPU had AVX-512 BF16, or AVX2 with FMA and F16C, when it
   was compiled), else 0 */
int group_kernel_available(void) {
#if defined(BF16_PATH) || defined(AVX2_PATH)
  return 1;
#else
  return 0;
#endif
}

/* 1 where this build takes float32 rows (`floats` below): its AVX2 path, which multiplies in
   float32, so float32 rows lose nothing to bfloat16's rounding */
int group_kernel_floats(void) {
#if defined(AVX2_PATH)
  return 1;
#else
  return 0;
#endif
}

/* 1 where this build multiplies bfloat16 rows by VDPBF16PS (or AMX tiles): its AVX-512 BF16
   path; elsewhere bfloat16 rows go to float32 first */
int group_kernel_bfloat16(void) {
#if defined(BF16_PATH)
  return 1;
#else
  return 0;
#endif
}

/* 1 where this process multiplies bfloat16 rows with AMX tiles (this build has them, and the
   kernel granted their state), else 0; `use` 0 switches them off for the process, 1 back on
   where granted, -1 only asks */
int group_kernel_tiles(int use) {
#if defined(TILES_PATH)
  if (use == 0) tiles = 0;
  if (use == 1) tiles = -1;
  return tiles_in_use();
#else
  (void)use;
  return 0;
#endif
}

/* 1 where this process multiplies quantized rows (w4a8) by AVX-512 VNNI (this build has it),
   else 0; `use` 0 switches it off for the process (the AVX2 code then runs), 1 back on, -1
   only asks: for side-by-side timings, and the test that both give the same bits */
int group_kernel_vnni(int use) {
#if defined(VNNI_PATH)
  if (use == 0 || use == 1) vnni = use;
  return vnni;
#else
  (void)use;
  return 0;
#endif
}

#if defined(BF16_PATH)
/* the AVX-512 path's products: on the tiles where this process uses them, else dot products;
   y bfloat16, or float32 where `wide`. Here, as quantized_block is, since it picks between two
   headers: the tiles build on group_kernel_bf16.h's helpers, and that header needs none of
   theirs */
static inline __attribute__((always_inline)) void multiply(
    const uint16_t* x, const uint8_t* packed, const uint16_t* scales, const uint16_t* minimums,
    const float* sums, void* y, int64_t M, int64_t N, int64_t K, const int bits, const int wide) {
#if defined(TILES_PATH)
  if (tiles_in_use()) {
    product_tiles(x, packed, scales, minimums, sums, y, M, N, K, bits, wide);
    return;
  }
#endif
  product(x, packed, scales, minimums, sums, y, M, N, K, bits, wide);
}
#endif

/* The entry points. x (M, K) and y (M, N): bfloat16, or float32 where `floats`: bfloat16 rows
   by the AVX-512 BF16 path where the build has it, float32 rows (and, without it, bfloat16
   ones) by the AVX2 path. Each returns 0 when done, 1 where this build does not multiply so,
   2 out of memory. */

/* int4 */
int int4_product(const void* x, const uint8_t* packed, const uint16_t* scales,
                 const uint16_t* minimums, void* y, int64_t M, int64_t N, int64_t K, int floats) {
#if defined(BF16_PATH)
  if (!floats) {
    const int64_t G = K / 32;
    float* sums = malloc(sizeof(float) * M * G);  /* sum_k x_k per row and group */
    if (sums == NULL) return 2;
    for (int64_t r = 0; r < M * G; r++) sums[r] = group_sum((const uint16_t*)x + r * 32);
    multiply(x, packed, scales, minimums, sums, y, M, N, K, 4, 0);
    free(sums);
    return 0;
  }
#endif
#if defined(AVX2_PATH)
  return avx2_entry(x, floats, packed, scales, minimums, y, M, N, K, 4, 0);
#else
  (void)x, (void)packed, (void)scales, (void)minimums, (void)y, (void)M, (void)N, (void)K;
  return 1;
#endif
}

/* int8; y float32 where `wide` whatever the rows (an LM head's logits: bfloat16 would round
   them, and close ones would tie) */
int int8_product(const void* x, const uint8_t* packed, const uint16_t* scales, void* y,
                 int64_t M, int64_t N, int64_t K, int floats, int wide) {
#if defined(BF16_PATH)
  if (!floats) {
    if (wide)  /* each a copy with `wide` a constant */
      multiply(x, packed, scales, NULL, NULL, y, M, N, K, 8, 1);
    else
      multiply(x, packed, scales, NULL, NULL, y, M, N, K, 8, 0);
    return 0;
  }
#endif
#if defined(AVX2_PATH)
  return avx2_entry(x, floats, packed, scales, NULL, y, M, N, K, 8, wide);
#else
  (void)x, (void)packed, (void)scales, (void)y, (void)M, (void)N, (void)K, (void)wide;
  return 1;
#endif
}

/* bfloat16 weights (the bfloat16 format's block products: pack_bfloat16's layout, each pair of
   inputs' 16 outputs side by side as VDPBF16PS reads them) times bfloat16 rows, float32 sums;
   y bfloat16, or float32 where `wide`. The AVX-512 BF16 path only: elsewhere oneDNN multiplies
   (packed_linear.py). Never on the tiles: their layout is int4's */
int bf16_product(const void* x, const uint8_t* packed, void* y, int64_t M, int64_t N, int64_t K,
                 int floats, int wide) {
#if defined(BF16_PATH)
  if (!floats) {
    if (wide)
      product(x, packed, NULL, NULL, NULL, y, M, N, K, 16, 1);
    else
      product(x, packed, NULL, NULL, NULL, y, M, N, K, 16, 0);
    return 0;
  }
#endif
  (void)x, (void)packed, (void)y, (void)M, (void)N, (void)K, (void)floats, (void)wide;
  return 1;
}

#if defined(A8_PATH)
/* one block of 16 outputs for `n` rows, by the rows' bits and the weights': on the VNNI path
   where this process uses it (n up to ROWS_V), else on the AVX2 one (n up to ROWS_Q) */
static inline __attribute__((always_inline)) void quantized_block(
    const Rows* r, const uint8_t* w, const uint16_t* s, const uint16_t* mn, void* y, int64_t at,
    int64_t N, int64_t K, const int n, const int floats, const int weight_bits,
    const int row_bits, const int use_vnni) {
#if defined(VNNI_PATH)
  if (use_vnni) {
    if (row_bits == 8)
      block_rows8_vnni(r, w, s, mn, y, at, N, K, n, floats);
    else if (weight_bits == 4)
      block_rows16_vnni(r, w, s, mn, y, at, N, K, n, floats);
    else
      block_rows16_int8_vnni(r, w, s, y, at, N, K, n, floats);
    return;
  }
#endif
  (void)use_vnni;
  if (n > ROWS_Q) return;  /* never: a pass takes ROWS_Q rows here */
  if (row_bits == 8)
    block_rows8(r, w, s, mn, y, at, N, K, n, floats);
  else if (weight_bits == 4)
    block_rows16(r, w, s, mn, y, at, N, K, n, floats);
  else
    block_rows16_int8(r, w, s, y, at, N, K, n, floats);
}

/* the products of quantized rows: the rows to `row_bits` (8, 16) bits a group of 32, then each
   task a block of 16 outputs for every row, ROWS_Q at a time; `weight_bits` 4 (w4a8's layout)
   or 8 (the int8 layout, 16-bit rows only). 0 done, 2 out of memory */
static inline __attribute__((always_inline)) int quantized_rows_product(
    const void* x, const int floats, const uint8_t* packed, const uint16_t* scales,
    const uint16_t* minimums, void* y, const int wide, int64_t M, int64_t N, int64_t K,
    const int weight_bits, const int row_bits) {
  const int64_t G = K / 32;
  Rows r;
  if (!(row_bits == 8 ? rows_as_int8(x, floats, M, K, &r)
                      : rows_as_int16(x, floats, M, K, &r, weight_bits == 8)))
    return 2;
#if defined(VNNI_PATH)
  const int use_vnni = vnni, pass = vnni ? ROWS_V : ROWS_Q;  /* rows a pass over the weights */
#else
  const int use_vnni = 0, pass = ROWS_Q;
#endif
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < N / 16; b++) {
    const uint8_t* w = packed + b * G * 64 * weight_bits;
    const uint16_t *s = scales + b * G * 16, *mn = minimums ? minimums + b * G * 16 : NULL;
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
      const Rows rm = {r.a8 ? r.a8 + m0 * K : NULL, r.a16 ? r.a16 + m0 * K : NULL,
                       r.d + m0 * G, r.sums + m0 * G};
      const int64_t at = m0 * N + b * 16;  /* y's first element for these rows and outputs */
      switch (M - m0 < pass ? (int)(M - m0) : pass) {
#define ROWS_OF(n) case n: \
  quantized_block(&rm, w, s, mn, y, at, N, K, n, wide, weight_bits, row_bits, use_vnni); break;
        ROWS_OF(1) ROWS_OF(2) ROWS_OF(3) ROWS_OF(4)
#if defined(VNNI_PATH)
        ROWS_OF(5) ROWS_OF(6) ROWS_OF(7) ROWS_OF(8)
#endif
#undef ROWS_OF
      }
    }
  }
  free(r.d);
  return 0;
}
#endif

/* w4a8: the int4 layout times 8-bit activations */
int int4_a8_product(const void* x, const uint8_t* packed, const uint16_t* scales,
                    const uint16_t* minimums, void* y, int64_t M, int64_t N, int64_t K,
                    int floats) {
#if defined(A8_PATH)
  return quantized_rows_product(x, floats, packed, scales, minimums, y, floats, M, N, K, 4, 8);
#else
  (void)x, (void)packed, (void)scales, (void)minimums, (void)y, (void)M, (void)N, (void)K;
  (void)floats;
  return 1;
#endif
}

/* w4a8's layout times 16-bit activations (the w4a8 format's other products) */
int int4_a16_product(const void* x, const uint8_t* packed, const uint16_t* scales,
                     const uint16_t* minimums, void* y, int64_t M, int64_t N, int64_t K,
                     int floats) {
#if defined(A8_PATH)
  return quantized_rows_product(x, floats, packed, scales, minimums, y, floats, M, N, K, 4, 16);
#else
  (void)x, (void)packed, (void)scales, (void)minimums, (void)y, (void)M, (void)N, (void)K;
  (void)floats;
  return 1;
#endif
}

/* the int8 layout (an LM head's 8-bit groups) times 16-bit activations; y as int8_product's */
int int8_a16_product(const void* x, const uint8_t* packed, const uint16_t* scales, void* y,
                     int64_t M, int64_t N, int64_t K, int floats, int wide) {
#if defined(A8_PATH)
  return quantized_rows_product(x, floats, packed, scales, NULL, y, floats || wide, M, N, K, 8,
                                16);
#else
  (void)x, (void)packed, (void)scales, (void)y, (void)M, (void)N, (void)K, (void)floats;
  (void)wide;
  return 1;
#endif
}
