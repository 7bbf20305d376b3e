/* What both C kernels share (group_kernel.c, attention_kernel.c): asking for memory ahead of
   the loops that read it (a prefetch: GCC's and Clang's builtin, on any CPU). */
#ifndef MINIMEDUSA_KERNELS_COMMON_H
#define MINIMEDUSA_KERNELS_COMMON_H

#include <stdint.h>

/* Every kernel reads its weights (or the cache's keys and values) once a call, in order,
   straight from memory (the model's
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

/* ask for the `bytes` at p + AHEAD (a group's weights, AHEAD further on), to read, into every
   cache level; always inlined: as a plain `static inline`, gcc 12 left no prefetch in the
   kernels */
static inline __attribute__((always_inline)) void fetch_ahead(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char*)p + AHEAD + at, 0, 3);
}

#endif
