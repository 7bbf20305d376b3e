/* The torch operators of this project's C kernels (minimedusa::int4_product, ::int4_a8_product,
   ::int8_product, ::step_attention), in C++: each checks its tensors, allocates its output and
   calls the kernel's C function, linked from the kernel's library (group_kernel.c,
   attention_kernel.c; built by c_kernels.py).

   Why C++: a torch operator whose kernel is a Python function costs ~35 us a call on a 2-core
   CPU (the dispatcher calling back into Python, the tensors' sizes and addresses read there,
   ctypes' argument conversion) around a kernel of ~60 us; a decoding step calls ~150 of them.
   From C++ the same call costs a few us. The operators' schemas and their fake (shape-only)
   versions, which torch.compile traces with, stay in Python beside each kernel
   (group_kernel.py, attention_kernel.py); this file only registers what they run on a CPU.

   Shapes: M rows, K inputs, N outputs, B = N / 16 blocks of outputs, G = K / 32 groups; H query
   heads, G key/value heads, T rows, S attended slots, D head dim. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

extern "C" {
/* group_kernel.c's entry points: 0 done, 1 this build does not multiply so, 2 out of memory */
int int4_product(const void* x, const uint8_t* packed, const uint16_t* scales,
                 const uint16_t* minimums, void* y, int64_t M, int64_t N, int64_t K, int floats);
int int4_a8_product(const void* x, const uint8_t* packed, const uint16_t* scales,
                    const uint16_t* minimums, void* y, int64_t M, int64_t N, int64_t K,
                    int floats);
int int8_product(const void* x, const uint8_t* packed, const uint16_t* scales, void* y,
                 int64_t M, int64_t N, int64_t K, int floats);

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

/* rows (M, K) times a packed weight whose scales are (B, G, 16): a new (M, N), rows' dtype */
at::Tensor output(const at::Tensor& rows, const at::Tensor& scales) {
  return at::empty({rows.size(0), scales.size(0) * 16}, rows.options());
}

const uint16_t* halves(const at::Tensor& t) {  /* float16 scales and minimums, as bits */
  return static_cast<const uint16_t*>(t.const_data_ptr());
}

/* the int4 layout's two products: float rows (int4_product) or rows rounded to 8 bits inside
   the kernel (int4_a8_product, the w4a8 format) */
using Int4Product = int (*)(const void*, const uint8_t*, const uint16_t*, const uint16_t*, void*,
                            int64_t, int64_t, int64_t, int);

at::Tensor int4_layout(Int4Product product, const char* what, const at::Tensor& rows_,
                       const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& minimums) {
  const at::Tensor rows = rows_.contiguous();
  at::Tensor y = output(rows, scales);
  check(product(rows.const_data_ptr(), packed.const_data_ptr<uint8_t>(), halves(scales),
                halves(minimums), y.mutable_data_ptr(), rows.size(0), y.size(1), rows.size(1),
                floats(rows)),
        what);
  return y;
}

at::Tensor int4_op(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales,
                   const at::Tensor& minimums) {
  return int4_layout(int4_product, "its sums", rows, packed, scales, minimums);
}

at::Tensor int4_a8_op(const at::Tensor& rows, const at::Tensor& packed,
                      const at::Tensor& scales, const at::Tensor& minimums) {
  return int4_layout(int4_a8_product, "the rows' 8-bit copy", rows, packed, scales, minimums);
}

at::Tensor int8_op(const at::Tensor& rows_, const at::Tensor& packed, const at::Tensor& scales) {
  const at::Tensor rows = rows_.contiguous();
  at::Tensor y = output(rows, scales);
  check(int8_product(rows.const_data_ptr(), packed.const_data_ptr<uint8_t>(), halves(scales),
                     y.mutable_data_ptr(), rows.size(0), y.size(1), rows.size(1), floats(rows)),
        "its rows in float32");
  return y;
}

/* q (1, H, T, D), k and v (1, G, S, D) with each key a contiguous row of D (cache slices), mask
   (1, 1, T, S) bool -> (1, H, T, D) laid out as (1, T, H, D): the block's next reshape to
   (1, T, H * D) is then a view, not a copy (attention_kernel.new_output, its fake twin) */
at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& mask_) {
  const int64_t H = q.size(1), T = q.size(2), D = q.size(3), G = k.size(1), S = k.size(2);
  at::Tensor out = at::empty({1, T, H, D}, q.options()).transpose(1, 2);
  const at::Tensor mask = mask_.contiguous();
  const Step step = {q.const_data_ptr(), k.const_data_ptr(), v.const_data_ptr(),
                     reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>()),
                     out.mutable_data_ptr(), H, G, T, S, D, q.stride(1), q.stride(2),
                     k.stride(1), out.stride(1), out.stride(2),
                     q.scalar_type() == at::kBFloat16, static_cast<float>(std::pow(D, -0.5))};
  const int done = attend(&step);
  TORCH_CHECK(done != 1, "attention_kernel.c does not take a head dim of ", D, " or ", H,
              " query heads over ", G, " key/value heads");
  TORCH_CHECK_WITH(OutOfMemoryError, done != 2, "attention_kernel.c could not allocate its "
                                                "scores");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minimedusa, CPU, m) {
  m.impl("int4_product", TORCH_FN(int4_op));
  m.impl("int4_a8_product", TORCH_FN(int4_a8_op));
  m.impl("int8_product", TORCH_FN(int8_op));
  m.impl("step_attention", TORCH_FN(attention_op));
}
