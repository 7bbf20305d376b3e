/* The torch operators of this project's C kernels (minimedusa::int4_product, ::int4_a8_product,
   ::int4_a16_product, ::int8_product, ::int8_a16_product, ::bf16_product, ::step_attention), in
   C++: each checks its tensors (operators.h), allocates its output and calls the kernel's C
   function, linked from the kernel's library (group_kernel.c, attention_kernel.c; built by
   c_kernels.py). The fused blocks (::blocks_step) are blocks_operator.cpp's, the Hydra draft
   (::hydra_draft, ::hydra_draw) draft_operator.cpp's: built with this file into one library.

   Why C++: a torch operator whose kernel is a Python function costs ~35 us a call on a 2-core
   CPU (the dispatcher calling back into Python, the tensors' sizes and addresses read there,
   ctypes' argument conversion) around a kernel of ~60 us; a decoding step calls ~150 of them.
   From C++ the same call costs a few us. The operators' schemas and their fake (shape-only)
   versions, which torch.compile traces with, stay in Python beside each kernel
   (group_kernel.py, attention_kernel.py); this file only registers what they run on a CPU.
   Shapes: operators.h's. */
#include "operators.h"

namespace {

/* the int4 weights' products: float rows (int4_product), or rows rounded to 8 or 16 bits inside
   the kernel (int4_a8_product, int4_a16_product: the w4a8 format) */
using Int4Product = int (*)(const void*, const uint8_t*, const uint16_t*, const uint16_t*, void*,
                            int64_t, int64_t, int64_t, int);

at::Tensor int4_layout(Int4Product product, const char* op, const char* what,
                       const at::Tensor& rows_,
                       const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& minimums) {
  const at::Tensor rows = rows_.contiguous();
  check_rows(op, rows);
  check_weight(op, packed, scales, &minimums, 16, -1, rows.size(1));
  at::Tensor y = output(rows, scales);
  check(product(rows.const_data_ptr(), packed.const_data_ptr<uint8_t>(), halves(scales),
                halves(minimums), y.mutable_data_ptr(), rows.size(0), y.size(1), rows.size(1),
                floats(rows)),
        what);
  return y;
}

at::Tensor int4_op(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales,
                   const at::Tensor& minimums) {
  return int4_layout(int4_product, "int4_product", "its sums", rows, packed, scales, minimums);
}

at::Tensor int4_a8_op(const at::Tensor& rows, const at::Tensor& packed,
                      const at::Tensor& scales, const at::Tensor& minimums) {
  return int4_layout(int4_a8_product, "int4_a8_product", "the rows' 8-bit copy", rows, packed,
                     scales, minimums);
}

at::Tensor int4_a16_op(const at::Tensor& rows, const at::Tensor& packed,
                       const at::Tensor& scales, const at::Tensor& minimums) {
  return int4_layout(int4_a16_product, "int4_a16_product", "the rows' 16-bit copy", rows,
                     packed, scales, minimums);
}

/* the int8 layout's products: float rows (int8_product), or rows rounded to 16 bits inside the
   kernel (int8_a16_product: the w4a8 format's LM head); y in the rows' dtype, or float32 where
   `wide` (a model's logits) */
using Int8Product = int (*)(const void*, const uint8_t*, const uint16_t*, void*, int64_t,
                            int64_t, int64_t, int, int);

at::Tensor int8_layout(Int8Product product, const char* op, const char* what,
                       const at::Tensor& rows_, const at::Tensor& packed,
                       const at::Tensor& scales, bool wide) {
  const at::Tensor rows = rows_.contiguous();
  check_rows(op, rows);
  check_weight(op, packed, scales, nullptr, 32, -1, rows.size(1));
  at::Tensor y = at::empty({rows.size(0), scales.size(0) * 16},
                           rows.options().dtype(wide ? at::kFloat : rows.scalar_type()));
  check(product(rows.const_data_ptr(), packed.const_data_ptr<uint8_t>(), halves(scales),
                y.mutable_data_ptr(), rows.size(0), y.size(1), rows.size(1), floats(rows), wide),
        what);
  return y;
}

at::Tensor int8_op(const at::Tensor& rows, const at::Tensor& packed, const at::Tensor& scales,
                   bool wide) {
  return int8_layout(int8_product, "int8_product", "its rows in float32", rows, packed, scales,
                     wide);
}

at::Tensor int8_a16_op(const at::Tensor& rows, const at::Tensor& packed,
                       const at::Tensor& scales, bool wide) {
  return int8_layout(int8_a16_product, "int8_a16_product", "the rows' 16-bit copy", rows,
                     packed, scales, wide);
}

/* bfloat16 weights (pack_bfloat16's layout: (B, 32 K) bytes) times bfloat16 rows: (M, N), the
   rows' dtype, or float32 where `wide` */
at::Tensor bf16_op(const at::Tensor& rows_, const at::Tensor& packed, bool wide) {
  const at::Tensor rows = rows_.contiguous();
  check_rows("bf16_product", rows);
  check_bf16_weight("bf16_product", packed, -1, rows.size(1));
  at::Tensor y = at::empty({rows.size(0), packed.size(0) * 16},
                           rows.options().dtype(wide ? at::kFloat : rows.scalar_type()));
  check(bf16_product(rows.const_data_ptr(), packed.const_data_ptr<uint8_t>(),
                     y.mutable_data_ptr(), rows.size(0), y.size(1), rows.size(1), floats(rows),
                     wide),
        "nothing");
  return y;
}

/* q (B, H, T, D), k and v (B, G, S, D) with each key a contiguous row of D (cache slices), mask
   (B or 1, 1, T, S) bool -> (B, H, T, D) laid out as (B, T, H, D): the block's next reshape to
   (B, T, H * D) is then a view, not a copy (attention_kernel.new_output, its fake twin). Each
   of the B sequences (a batch's rows) attends its own keys in one call, as the fused step's
   do: a row's bits the same as alone */
/* What step_attention takes, checked before any pointer is read: the kernel indexes q by its
   strides, k and v by k's (each key a contiguous row of D values), the mask as contiguous
   (B or 1, 1, T, S) */
void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4,
              "step_attention: q (B, H, T, D), k and v (B, G, S, D) and the mask (B or 1, 1, T, "
              "S) are 4-D, not ", q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ",
              mask.sizes());
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  mask.scalar_type() == at::kBool,
              "step_attention: q, k and v are all float32 or all bfloat16, the mask bool, not ",
              q.dtype(), ", ", k.dtype(), ", ", v.dtype(), ", ", mask.dtype());
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && k.size(1) > 0 &&
                  H % k.size(1) == 0 && S > 0,
              "step_attention: k and v ", k.sizes(), " and ", v.sizes(), " do not fit q ",
              q.sizes(), " (the same sequences and head dim, at least one slot, H a multiple "
              "of G)");
  TORCH_CHECK((mask.size(0) == B || mask.size(0) == 1) && mask.size(1) == 1 &&
                  mask.size(2) == T && mask.size(3) == S,
              "step_attention: the mask ", mask.sizes(), " does not fit ", T, " rows over ", S,
              " slots");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && (S == 1 || k.stride(2) == D) &&
                  v.strides() == k.strides(),
              "step_attention: each key is a contiguous row of D values, v laid out as k; k's "
              "strides ", k.strides(), ", v's ", v.strides());
}

at::Tensor attention_op(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& mask_) {
  /* a query row of D values side by side, as the kernel reads it (others only where a caller
     slices q otherwise: a copy) */
  const at::Tensor q = q_.dim() == 4 && q_.stride(3) != 1 ? q_.contiguous() : q_;
  check_attention(q, k, v, mask_);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), G = k.size(1),
                S = k.size(2);
  at::Tensor out = at::empty({B, T, H, D}, q.options()).transpose(1, 2);
  const at::Tensor mask = mask_.contiguous();
  const Step step = {q.const_data_ptr(), k.const_data_ptr(), v.const_data_ptr(),
                     reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>()),
                     out.mutable_data_ptr(), H, G, T, S, D, q.stride(1), q.stride(2),
                     k.stride(1), out.stride(1), out.stride(2),
                     q.scalar_type() == at::kBFloat16, static_cast<float>(std::pow(D, -0.5)),
                     B, q.stride(0), k.stride(0), mask.size(0) == 1 ? 0 : T * S,
                     out.stride(0)};
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
  m.impl("int4_a16_product", TORCH_FN(int4_a16_op));
  m.impl("int8_product", TORCH_FN(int8_op));
  m.impl("int8_a16_product", TORCH_FN(int8_a16_op));
  m.impl("bf16_product", TORCH_FN(bf16_op));
  m.impl("step_attention", TORCH_FN(attention_op));
}
