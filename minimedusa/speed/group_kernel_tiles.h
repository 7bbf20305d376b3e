/* group_kernel.c's AMX tiles, inside its AVX-512 BF16 path: they convert the weights, end a
   group and store as its dot products do (group_kernel_bf16.h's BF16_OF, quad_weights,
   pair_weights8, add_group, store_rows) */
#ifndef MINIMEDUSA_GROUP_KERNEL_TILES_H
#define MINIMEDUSA_GROUP_KERNEL_TILES_H
#include "group_kernel_bf16.h"

#if defined(BF16_PATH) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define TILES_PATH 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels_common.h"

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
#endif  /* TILES_PATH */
#endif
