/* group_kernel.c's store of 8 float32 sums into the caller's rows: the last step of its AVX2
   path (group_kernel_avx2.h) and of w4a8's (group_kernel_w4a8.h, group_kernel_vnni.h) */
#ifndef MINIMEDUSA_GROUP_KERNEL_STORE8_H
#define MINIMEDUSA_GROUP_KERNEL_STORE8_H
#if defined(__AVX2__)
#include <immintrin.h>
#include <stdint.h>

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
#endif
