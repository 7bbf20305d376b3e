/* What the C kernels' torch operators share (operators.cpp: the products and the attention;
   blocks_operator.cpp: the fused blocks; draft_operator.cpp: the Hydra draft): the kernels' C
   entry points, linked from their libraries (group_kernel.c, attention_kernel.c; built by
   c_kernels.py), and the checks every operator makes of its tensors before a pointer is read:
   a wrong shape, dtype or layout is one line (TORCH_CHECK), never a read past a tensor.

   Shapes: M rows, K inputs, N outputs, B = N / 16 blocks of outputs, G = K / 32 groups; H query
   heads, G key/value heads, T rows, S attended slots, D head dim. */
#ifndef MINIMEDUSA_OPERATORS_H
#define MINIMEDUSA_OPERATORS_H

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

extern "C" {
/* group_kernel.c's entry points: 0 done, 1 this build does not multiply so, 2 out of memory */
int int4_product(const void* x, const uint8_t* packed, const uint16_t* scales,
                 const uint16_t* minimums, void* y, int64_t M, int64_t N, int64_t K, int floats);
int int4_a8_product(const void* x, const uint8_t* packed, const uint16_t* scales,
                    const uint16_t* minimums, void* y, int64_t M, int64_t N, int64_t K,
                    int floats);
int int4_a16_product(const void* x, const uint8_t* packed, const uint16_t* scales,
                     const uint16_t* minimums, void* y, int64_t M, int64_t N, int64_t K,
                     int floats);
int int8_product(const void* x, const uint8_t* packed, const uint16_t* scales, void* y,
                 int64_t M, int64_t N, int64_t K, int floats, int wide);
int int8_a16_product(const void* x, const uint8_t* packed, const uint16_t* scales, void* y,
                     int64_t M, int64_t N, int64_t K, int floats, int wide);
int bf16_product(const void* x, const uint8_t* packed, void* y, int64_t M, int64_t N, int64_t K,
                 int floats, int wide);

/* attention_kernel.c's Step and entry point (0 done, 1 a shape it does not take, 2 out of
   memory): the tensors' addresses, sizes and strides in elements */
typedef struct {
  const void *q, *k, *v;
  const uint8_t* mask;
  void* out;
  int64_t H, G, T, S, D;
  int64_t q_head, q_row;
  int64_t kv_head;
  int64_t out_head, out_row;
  int bf16;
  float scale;
  int64_t B, q_seq, kv_seq, mask_seq, out_seq;  /* B sequences, and the strides between them */
} Step;
int attend(const Step* a);
}

namespace {

/* the kernels' `floats` argument: 1 for float32 rows, 0 for bfloat16 */
int floats(const at::Tensor& rows) {
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16,
                   "group_kernel.c multiplies bfloat16 or float32 rows, not ", rows.dtype());
  return rows.scalar_type() == at::kFloat;
}

/* what a product's return code says, as torch's errors */
void check(int done, const char* what) {
  TORCH_CHECK(done != 1, "this build of group_kernel.c multiplies bfloat16 rows only "
                         "(takes_float32)");
  TORCH_CHECK_WITH(OutOfMemoryError, done != 2, "group_kernel.c could not allocate ", what);
}

/* A packed weight of K inputs (and N outputs, where N >= 0), checked before any pointer is
   read (a wrong shape would have the kernel read past the weight, or write past y): its scales
   (and minimums: the same) (N / 16, K / 32, 16) float16 and contiguous; its packed bytes
   uint8, contiguous, (N / 16, ...): `bytes` for each output and group of 32 inputs (int4 16,
   int8 32). */
void check_weight(const char* op, const at::Tensor& packed, const at::Tensor& scales,
                  const at::Tensor* minimums, int64_t bytes, int64_t N, int64_t K) {
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == 16 && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous(),
              op, ": the scales are contiguous float16 (N / 16, K / 32, 16), not ",
              scales.sizes(), " ", scales.dtype());
  TORCH_CHECK(minimums == nullptr ||
                  (minimums->sizes() == scales.sizes() &&
                   minimums->scalar_type() == at::kHalf && minimums->is_contiguous()),
              op, ": the minimums are contiguous float16 ", scales.sizes(), " as the scales");
  const int64_t B = scales.size(0);
  TORCH_CHECK(32 * scales.size(1) == K && (N < 0 || 16 * B == N), op, ": the weight is ",
              16 * B, " x ", 32 * scales.size(1), " (outputs x inputs), where ",
              N < 0 ? "" : std::to_string(N) + " x ", K, " is wanted");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() >= 1 &&
                  packed.size(0) == B && packed.numel() == 16 * B * K / 32 * bytes,
              op, ": the packed weight is contiguous uint8, ", B, " blocks of ",
              16 * K / 32 * bytes, " bytes, not ", packed.sizes(), " ", packed.dtype());
}

/* bfloat16 weights in pack_bfloat16's layout, (N / 16, 32 K) bytes, checked as check_weight */
void check_bf16_weight(const char* op, const at::Tensor& packed, int64_t N, int64_t K) {
  TORCH_CHECK(K % 32 == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.dim() == 2 && (N < 0 || 16 * packed.size(0) == N) &&
                  packed.size(1) == 32 * K,
              op, ": the packed weight is contiguous uint8 (N / 16, 32 K) with K = ", K,
              " a multiple of 32", N < 0 ? "" : " and N = " + std::to_string(N), ", not ",
              packed.sizes(), " ", packed.dtype());
}

/* rows as a product takes them: (M, K) */
void check_rows(const char* op, const at::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 2, op, ": the rows are (M, K), not ", rows.sizes());
}

/* rows (M, K) times a packed weight whose scales are (B, G, 16): a new (M, N), rows' dtype */
at::Tensor output(const at::Tensor& rows, const at::Tensor& scales) {
  return at::empty({rows.size(0), scales.size(0) * 16}, rows.options());
}

const uint16_t* halves(const at::Tensor& t) {  /* float16 scales and minimums, as bits */
  return static_cast<const uint16_t*>(t.const_data_ptr());
}

/* x as float32, and float32 rounded to E (to nearest even for bfloat16, as torch casts) */
inline float wide(float x) { return x; }
inline float wide(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename E> inline E narrow(float x) { return static_cast<E>(x); }

}  // namespace

#endif
