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
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>

/* Every kernel below reads its weights once a call, in order, straight from memory (the model's
   ~60 MB of blocks pass through the caches each step). Asked for only as the loop reaches them,
   they came at ~20 GB/s a core at 1 row (the machine reads 72 GB/s), and at 8 rows the loop
   still waited on them: a core keeps too few misses in flight, and the hardware prefetcher
   ramps up late in each thread's run of blocks. So each group first asks for the bytes AHEAD
   further on (prefetch: no fault past an array's end, no change to any result). On the 2-core
   Zen 5 (a throwaway harness, the default model's 120 block products, int4, bfloat16 rows, 2
   threads, the best of 20): 1 / 2 / 3 / 4 / 8 rows 1.55 / 1.63 / 1.84 / 2.14 / 3.24 ms -> 1.09
   / 1.31 / 1.66 / 1.90 / 2.62 with 8 KB ahead (4 KB: 1.13 / 1.28 / 1.57 / 1.78 / 2.54; 16 KB:
   1.18 / 1.37 / 1.72 / 1.92 / 2.65). Other CPUs: unmeasured. */
enum { AHEAD = 8192 };

/* ask for the `bytes` at w + AHEAD (a group's weights, AHEAD further on); always inlined: as a
   plain `static inline`, gcc 12 left no prefetch in the kernels */
static inline __attribute__((always_inline)) void fetch_ahead(const uint8_t* w, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch((const char*)w + AHEAD + at, _MM_HINT_T0);
}

/* 8 sums stored as the caller's rows are: float32 where `floats`, else bfloat16 to nearest
   even (no NaN here: the sums are finite); at: the first one's index in y */
static inline void store8(void* y, int64_t at, __m256 v, const int floats) {
  if (floats) {
    _mm256_storeu_ps((float*)y + at, v);
    return;
  }
  __m256i b = _mm256_castps_si256(v);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128((__m128i*)((uint16_t*)y + at), h);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_PATH 1

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define TILES_PATH 1
#include <sys/syscall.h>
#include <unistd.h>

/* AMX tiles (Intel since Sapphire Rapids): one tile product (TDPBF16PS) multiplies up to 16
   rows' 32 inputs of a group by its 16 outputs' weights, so a pass over the weights costs about
   the same for 1 row as for 16 (block_rows' VDPBF16PS does 16 dot products a row and group).
   The weights' conversion to bfloat16 (pair_weights: the same work as block_rows') is then most
   of a pass, once for up to 16 rows. pair_weights' 64 bytes of a pair of inputs are a row of the
   tile B exactly as TDPBF16PS pairs them (output n's inputs k and k + 1 side by side), and a
   group's rows of x (32 bfloat16 each) the tile A as they lie in memory: C = A B is each row's
   sum_k x_k q_k for 16 outputs, then scaled and given its minimum's term as block_rows does.
   Per row the same operations whatever rows beside it (each row of C depends only on its row
   of A): a row's bits stay the same at any row count, but they are not block_rows' bits, so
   one process uses one path for all its products (tiles_in_use). Measured on a 16-core Xeon
   (Sapphire Rapids kind) on 2 threads, the default model's block products at 1 / 8 / 16 rows:
   10.2 / 12.7 / 15.6 ms, block_rows' 9.5 / 22.3 / 39.7 (weights/RESULTS.md). */

enum { TILE_ROWS = 16 };

/* ldtilecfg's 64 bytes: palette 1; tile 0 C (n rows of 16 floats), tile 1 A (n rows of 32
   bfloat16), tile 2 B (16 pairs of inputs, each 16 outputs x 2 bfloat16) */
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

static void configure_tiles(int n) {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  c.rows[0] = c.rows[1] = (uint8_t)n;
  c.rows[2] = 16;
  c.colsb[0] = c.colsb[1] = c.colsb[2] = 64;
  _tile_loadconfig(&c);
}

/* 1 where this process may use the tiles: Linux hands out their state only to a process that
   asks (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), and some VMs refuse; -1 until
   asked. group_kernel_tiles can switch them off (a side-by-side comparison). */
static int tiles = -1;

static int tiles_in_use(void) {
  if (tiles < 0) tiles = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return tiles;
}

/* one block of 16 outputs for the n (<= TILE_ROWS) rows from m0, as block_rows, the tiles
   configured for n rows; b_tile (1 KB) and c_rows (n x 16 floats): the thread's scratch, 64-byte
   aligned */
static void block_tiles(const uint16_t* x, const uint8_t* w, const uint16_t* scales,
                        const uint16_t* minimums, const float* sums, void* y, int64_t b,
                        int64_t m0, int64_t N, int64_t K, __m512i table, int n, const int bits,
                        const int wide, uint8_t* b_tile, float* c_rows) {
  const int64_t G = K / 32, pair_bytes = 4 * bits;
  __m512 out[TILE_ROWS];
  for (int i = 0; i < n; i++) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++, w += 16 * pair_bytes) {
    fetch_ahead(w, 16 * pair_bytes);
    for (int p = 0; p < 16; p += 2) {  /* tile rows p, p + 1: the pairs of inputs p, p + 1 */
      __m512bh w0, w1;
      if (bits == 4) {
        quad_weights(w + p * 16, table, &w0, &w1);
      } else {
        w0 = pair_weights8(w + p * 32);
        w1 = pair_weights8(w + p * 32 + 32);
      }
      _mm512_store_si512(b_tile + 64 * p, (__m512i)w0);
      _mm512_store_si512(b_tile + 64 * p + 64, (__m512i)w1);
    }
    _tile_zero(0);
    _tile_loadd(1, x + m0 * K + g * 32, K * 2);  /* n rows' 32 inputs of group g */
    _tile_loadd(2, b_tile, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c_rows, 64);
    for (int i = 0; i < n; i++)
      out[i] = add_group(out[i], _mm512_load_ps(c_rows + 16 * i), scales + g * 16,
                         bits == 4 ? minimums + g * 16 : NULL,
                         bits == 4 ? sums[(m0 + i) * G + g] : 0.0f, bits);
  }
  store_rows(out, y, b, m0, N, n, wide);
}

/* product's work by tiles: each thread configures its own tiles (they are a thread's state) for
   the rows of a pass, TILE_ROWS at a time, and releases them when done */
static inline __attribute__((always_inline)) void product_tiles(
    const uint16_t* x, const uint8_t* packed, const uint16_t* scales, const uint16_t* minimums,
    const float* sums, void* y, int64_t M, int64_t N, int64_t K, const int bits, const int wide) {
  const int64_t G = K / 32;
  const __m512i table = _mm512_loadu_si512(BF16_OF);
#pragma omp parallel
  {
    uint8_t b_tile[1024] __attribute__((aligned(64)));
    float c_rows[TILE_ROWS * 16] __attribute__((aligned(64)));
    int configured = 0;  /* the rows the tiles are configured for, 0: not yet */
#pragma omp for schedule(static)
    for (int64_t b = 0; b < N / 16; b++) {
      const uint8_t* w = packed + b * G * 64 * bits;
      const uint16_t *s = scales + b * G * 16, *mn = bits == 4 ? minimums + b * G * 16 : NULL;
      for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const int n = M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS;
        if (n != configured) configure_tiles(configured = n);
        block_tiles(x, w, s, mn, sums, y, b, m0, N, K, table, n, bits, wide, b_tile, c_rows);
      }
    }
    if (configured) _tile_release();
  }
}
#endif

/* the AVX-512 path's products: on the tiles where this process uses them, else dot products;
   y bfloat16, or float32 where `wide` */
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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AVX2_PATH 1

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
#endif


#if defined(__AVX2__)
#define A8_PATH 1  /* the products of quantized rows: 8-bit (w4a8's first) and 16-bit */
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define VNNI_PATH 1

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
#endif
#endif

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
