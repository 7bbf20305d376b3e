/* The torch operators of this project's C kernels (minimedusa::int4_product, ::int4_a8_product,
   ::int4_a16_product, ::int8_product, ::int8_a16_product, ::bf16_product, ::step_attention), in
   C++: each checks
   its tensors, allocates its output and calls the kernel's C function, linked from the kernel's
   library (group_kernel.c, attention_kernel.c; built by c_kernels.py). And ::blocks_step, all
   the transformer blocks of an int4 model in one call (the fused step, fused_block.py), and
   ::hydra_draft, the Hydra heads' draft in one call (fused_draft.py), at the end of the file.

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

/* ---- all the blocks in one call (fused_block.py): the decoding step's transformer blocks of a
   model whose products are group_kernel.c's int4 (or w4a8) layers. model.Block is the reference:
   x + attn(norm(x)), then + mlp(norm(.)), each elementwise step below a loop over one row at a
   time, so that a row's bits depend on nothing beside it (the products' and the attention's own
   property): greedy Medusa stays lossless with respect to plain decoding.
   E is the activations' dtype (the products' rows, the cache, the norms' weights): float32 (the
   AVX2 path's) or bfloat16 (the AVX-512 BF16 path's). As model.py computes a bfloat16 block,
   the residual stream stays float32, each step computes in float32 and rounds its result to E
   once (the norm also before its weight, as RMSNorm casts first; SwiGLU after silu). */

/* x as float32, and float32 rounded to E (to nearest even for bfloat16, as torch casts) */
inline float wide(float x) { return x; }
inline float wide(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename E> inline E narrow(float x) { return static_cast<E>(x); }

/* sum_c x[c]^2 in double (exact enough for any C), in a fixed order: 8 running sums, sum l
   taking c = l, l + 8, ..., then added pairwise (two vectors of 4 doubles). With one running
   sum, each add waiting for the last, the norms took 1.12% of an 8-row forward's samples of the
   default model (perf, the 2-core Zen 5); so, 0.50%. */
inline double sum_of_squares(const float* x, int64_t C) {
  double sums[8] = {0.0};
  int64_t c = 0;
  for (; c + 8 <= C; c += 8)
    for (int l = 0; l < 8; l++) sums[l] += (double)x[c + l] * x[c + l];
  for (; c < C; c++) sums[c % 8] += (double)x[c] * x[c];
  return ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
}

/* out[t] = weight * E(x[t] / sqrt(mean(x[t]^2) + eps)), row by row: x float32 (T, C) */
template <typename E>
void rms_norm_rows(const float* x, const E* weight, E* out, int64_t T, int64_t C, double eps) {
  for (int64_t t = 0; t < T; t++) {
    const double squares = sum_of_squares(x + t * C, C);
    const float inverse = (float)(1.0 / std::sqrt(squares / C + eps));
    for (int64_t c = 0; c < C; c++)
      out[t * C + c] = narrow<E>(wide(weight[c]) * wide(narrow<E>(x[t * C + c] * inverse)));
  }
}

/* head of D values rotated as model.apply_rope: pairs (i, i + D/2) by the row's angles */
template <typename E>
void rope_head(const E* x, const float* cos, const float* sin, E* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i++) {
    const float a = wide(x[i]), b = wide(x[i + half]);
    out[i] = narrow<E>(a * cos[i] + (-b) * sin[i]);
    out[i + half] = narrow<E>(b * cos[i + half] + a * sin[i + half]);
  }
}

/* one of the block's 4 products, y (T, N) = x (T, K) W^T: W's packed weights, scales and
   minimums are products[3 i], [3 i + 1], [3 i + 2]; row_bits[i]: the bits its rows are rounded
   to inside the kernel (8, 16), or 0: float rows as they are, times int4 weights; or BF16_WEIGHTS:
   bfloat16 weights, whose scales and minimums are empty */
constexpr int64_t BF16_WEIGHTS = 1;

template <typename E>
void block_product(const at::TensorList products, at::IntArrayRef row_bits, int i, const E* x, E* y,
                   int64_t T, int64_t N, int64_t K) {
  if (row_bits[i] == BF16_WEIGHTS) {
    check(bf16_product(x, products[3 * i].const_data_ptr<uint8_t>(), y, T, N, K,
                       std::is_same_v<E, float>, 0),
          "nothing");
    return;
  }
  const auto product = row_bits[i] == 8    ? int4_a8_product
                       : row_bits[i] == 16 ? int4_a16_product
                                           : int4_product;
  check(product(x, products[3 * i].const_data_ptr<uint8_t>(), halves(products[3 * i + 1]),
                halves(products[3 * i + 2]), y, T, N, K, std::is_same_v<E, float>),
        "its rows");
}

/* a block's sizes: B sequences (a batch's rows, each its own cache row), T rows each, C model
   dim, H query heads, G key/value heads, D head dim, S attended slots, the cache's capacity, I
   the MLP's inner dim; R = B T rows in all */
struct Sizes {
  int64_t B, T, C, H, G, D, S, capacity, I, R;
};

/* A block's activations between its steps, one allocation for every block of a call (allocated
   per block, their 8 tensors a block took ~0.1 ms of a 2.5 ms forward: malloc, free, and
   torch's bookkeeping): hp and pp (T, C) the norm's output and a product's, qkv (T, (H + 2 G)
   D) wqkv's, q (T, H, D) the rotated queries, att (T, H, D) attention's output, both (T, 2 I)
   gate_up's, mid (T, I) silu(gate) * up. */
template <typename E>
struct Scratch {
  at::Tensor held;
  E *hp, *pp, *qkv, *q, *att, *both, *mid;

  Scratch(const Sizes& z, const at::TensorOptions& options) {
    const int64_t width = (z.H + 2 * z.G) * z.D, HD = z.H * z.D;
    held = at::empty({z.R * (2 * z.C + width + 2 * HD + 3 * z.I)}, options);
    hp = held.data_ptr<E>(), pp = hp + z.R * z.C, qkv = pp + z.R * z.C;
    q = qkv + z.R * width, att = q + z.R * HD, both = att + z.R * HD, mid = both + z.R * 2 * z.I;
  }
};

/* out (R, C) float32 += attn(norm(out)): q and k rotated, k and v written into the caches (B,
   G, capacity, D) at slot[r] (R slots: each row its own) or slot[t] (T: the same in every
   sequence), each sequence's rows attending its cache row's slots [0, S) as its mask (T, S)
   lets them */
template <typename E>
void attention_half(float* out, const E* norm, at::TensorList products, at::IntArrayRef row_bits,
                    const float* cos, const float* sin, const uint8_t* mask,
                    const int64_t* slot, bool slot_a_row, E* kc, E* vc, const Sizes& z,
                    double eps, const Scratch<E>& a) {
  const int64_t width = (z.H + 2 * z.G) * z.D;  /* wqkv's outputs: q, k, v side by side */
  const int64_t sequence = z.G * z.capacity * z.D;  /* a cache row's entries */
  E *hp = a.hp, *pp = a.pp, *qkvp = a.qkv, *qp = a.q;
  rms_norm_rows(out, norm, hp, z.R, z.C, eps);
  block_product(products, row_bits, 0, hp, qkvp, z.R, width, z.C);
  for (int64_t r = 0; r < z.R; r++) {
    const E* row = qkvp + r * width;
    const float *ct = cos + r * z.D, *st = sin + r * z.D;
    const int64_t written = slot[slot_a_row ? r : r % z.T];
    for (int64_t n = 0; n < z.H; n++)
      rope_head(row + n * z.D, ct, st, qp + (r * z.H + n) * z.D, z.D);
    for (int64_t g = 0; g < z.G; g++) {
      const int64_t at = (r / z.T) * sequence + (g * z.capacity + written) * z.D;
      rope_head(row + (z.H + g) * z.D, ct, st, kc + at, z.D);
      std::memcpy(vc + at, row + (z.H + z.G + g) * z.D, z.D * sizeof(E));
    }
  }
  /* each sequence's rows against its own cache row, in one call */
  const Step step = {qp, kc, vc, mask, a.att, z.H, z.G, z.T, z.S, z.D,
                     z.D, z.H * z.D, z.capacity * z.D, z.D, z.H * z.D,
                     !std::is_same_v<E, float>, static_cast<float>(std::pow(z.D, -0.5)),
                     z.B, z.T * z.H * z.D, sequence, z.T * z.S, z.T * z.H * z.D};
  TORCH_CHECK(attend(&step) == 0, "attention_kernel.c did not attend");
  block_product(products, row_bits, 1, a.att, pp, z.R, z.C, z.H * z.D);
  for (int64_t i = 0; i < z.R * z.C; i++) out[i] = out[i] + wide(pp[i]);
}

/* e^x in float32 operations that gcc vectorises (std::exp is a call per value: silu's loop took
   ~0.25 ms a row a step, 30 blocks): attention_kernel.c's exp_lanes for one value. x = k ln2 +
   r, |r| <= ln2 / 2, e^r by its Taylor polynomial, 2^k written into a float's exponent bits:
   within 3 ulps of e^x (measured over [-87, 88.3]). Below -87 it gives e^-87, which 1 + rounds
   away as it does e^x; from 88.38 inf, so silu of -88.4 is -0 where it is -3e-37. */
inline float exp_vectorisable(float x) {
  x = x < -87.0f ? -87.0f : x > 89.0f ? 89.0f : x;  /* compiled with -fno-trapping-math: blends */
  const float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  /* round(x / ln2) */
  const float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;  /* ln2 in two parts */
  const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666716e-2f +
                  r * (8.33333377e-3f + r * 1.38888892e-3f)))));
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  /* 2^k */
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return p * two_k;
}

/* m (I,) = silu(gate) * up for one row, each value rounded to E where model.MLP's are */
template <typename E>
void swiglu_row(const E* gate, const E* up, E* m, int64_t I) {
  for (int64_t i = 0; i < I; i++) {
    const float g = wide(gate[i]);
    m[i] = narrow<E>(wide(narrow<E>(g / (1.0f + exp_vectorisable(-g)))) * wide(up[i]));
  }
}

/* out (R, C) float32 += down(silu(gate) * up) of norm(out), gate and up side by side in
   gate_up's */
template <typename E>
void mlp_half(float* out, const E* norm, at::TensorList products, at::IntArrayRef row_bits,
              const Sizes& z, double eps, const Scratch<E>& a) {
  E *hp = a.hp, *pp = a.pp, *w = a.both, *m = a.mid;
  rms_norm_rows(out, norm, hp, z.R, z.C, eps);
  block_product(products, row_bits, 2, hp, w, z.R, 2 * z.I, z.C);
  for (int64_t r = 0; r < z.R; r++)
    swiglu_row(w + r * 2 * z.I, w + r * 2 * z.I + z.I, m + r * z.I, z.I);
  block_product(products, row_bits, 3, m, pp, z.R, z.C, z.I);
  for (int64_t i = 0; i < z.R * z.C; i++) out[i] = out[i] + wide(pp[i]);
}

/* the residual stream out (T, C) float32 through both halves of one block, activations in E */
template <typename E>
void block_halves(float* out, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& mask, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const int64_t* slot, bool slot_a_row, const at::Tensor& attn_norm,
                  const at::Tensor& mlp_norm,
                  at::TensorList products, at::IntArrayRef row_bits, const Sizes& z, double eps,
                  const Scratch<E>& scratch) {
  attention_half(out, attn_norm.const_data_ptr<E>(), products, row_bits,
                 cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
                 reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>()), slot, slot_a_row,
                 k_cache.data_ptr<E>(), v_cache.data_ptr<E>(), z, eps, scratch);
  mlp_half(out, mlp_norm.const_data_ptr<E>(), products, row_bits, z, eps, scratch);
}

/* every block in turn on the residual stream out (T, C) float32, activations in E */
template <typename E>
void blocks(float* out, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
            at::TensorList k_caches, at::TensorList v_caches, const int64_t* slot,
            bool slot_a_row,
            at::TensorList attn_norms, at::TensorList mlp_norms, at::TensorList products,
            at::IntArrayRef row_bits, const Sizes& z, double eps) {
  const Scratch<E> scratch(z, k_caches[0].options());
  for (int64_t b = 0; b < (int64_t)k_caches.size(); b++)
    block_halves<E>(out, cos, sin, mask, k_caches[b], v_caches[b], slot, slot_a_row,
                    attn_norms[b],
                    mlp_norms[b], products.slice(12 * b, 12), row_bits.slice(4 * b, 4), z, eps,
                    scratch);
}

/* a block's 4 products fit its sizes: wqkv (H + 2 G) D x C, wo C x H D, gate_up 2 I x C and
   down C x I, each as its row bits say it is packed (int4, or bfloat16 weights) */
void check_block_products(at::TensorList products, at::IntArrayRef row_bits, const Sizes& z) {
  const int64_t shapes[4][2] = {{(z.H + 2 * z.G) * z.D, z.C}, {z.C, z.H * z.D},
                                {2 * z.I, z.C}, {z.C, z.I}};
  for (int i = 0; i < 4; i++) {
    const int64_t bits = row_bits[i];
    TORCH_CHECK(bits == 0 || bits == 8 || bits == 16 || bits == BF16_WEIGHTS,
                "blocks_step: a product's row bits are 0, 8, 16 or 1 (bfloat16 weights), not ",
                bits);
    if (bits == BF16_WEIGHTS)
      check_bf16_weight("blocks_step", products[3 * i], shapes[i][0], shapes[i][1]);
    else
      check_weight("blocks_step", products[3 * i], products[3 * i + 1], &products[3 * i + 2],
                   16, shapes[i][0], shapes[i][1]);
  }
}

/* x (B, T, C) float32 (the residual stream: B sequences of T rows, a batch's); cos, sin (B, 1,
   T, D) float32; mask (B, 1, T, S) bool; per block b = 0 .. L - 1: its layer's cache
   k_caches[b] and v_caches[b] (B, G, capacity, D) in the activations' dtype (float32 or
   bfloat16), this step's keys and values written at slots (T,) in every sequence's row, or
   (B, T), each its own; its norms' weights attn_norms[b], mlp_norms[b] (C,), in that dtype;
   its products products[12 b .. 12 b + 12): wqkv, wo, gate_up, down as (packed, scales,
   minimums) each, and the bits each rounds its rows to, row_bits[4 b .. 4 b + 4) -> (B, T, C)
   float32: x through every block, one after another */
at::Tensor blocks_op(const at::Tensor& x_, const at::Tensor& cos_, const at::Tensor& sin_,
                     const at::Tensor& mask_, at::TensorList k_caches, at::TensorList v_caches,
                     const at::Tensor& slots_, at::TensorList attn_norms,
                     at::TensorList mlp_norms, at::TensorList products,
                     at::IntArrayRef row_bits, int64_t H, double eps) {
  const at::Tensor x = x_.contiguous(), cos = cos_.contiguous(), sin = sin_.contiguous();
  const at::Tensor mask = mask_.contiguous(), slots = slots_.contiguous();
  const int64_t L = k_caches.size();
  TORCH_CHECK(L > 0 && v_caches.size() == L && attn_norms.size() == L &&
                  mlp_norms.size() == L && products.size() == 12 * L &&
                  row_bits.size() == 4 * L,
              "blocks_step takes, for each block, its caches, 2 norms, 4 products and their "
              "row bits");
  const at::Tensor& k0 = k_caches[0];
  TORCH_CHECK(x.dim() == 3 && k0.dim() == 4 && mask.dim() == 4 && H > 0 && k0.size(1) > 0 &&
                  H % k0.size(1) == 0,
              "blocks_step: x (B, T, C), the caches (B, G, capacity, D) and the mask (B, 1, T, "
              "S) with H a multiple of G, not ", x.sizes(), ", ", k0.sizes(), ", ", mask.sizes(),
              " and H = ", H);
  /* I: down's inputs, its groups of 32 (int4) or its packed bytes over 32 (bfloat16) */
  const int64_t I = row_bits[3] == BF16_WEIGHTS ? products[9].size(-1) / 32
                                                : products[10].size(-2) * 32;
  const int64_t B = x.size(0), T = x.size(1);
  const Sizes z = {B, T, x.size(2), H, k0.size(1), k0.size(3), mask.size(-1), k0.size(2), I,
                   B * T};
  const auto dtype = k0.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && mask.scalar_type() == at::kBool &&
                  slots.scalar_type() == at::kLong &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "blocks_step takes float32 rows and angles, a bool mask, int64 slots, and caches "
              "in float32 or bfloat16");
  for (int64_t b = 0; b < L; b++) {
    TORCH_CHECK(k_caches[b].sizes() == k0.sizes() && v_caches[b].sizes() == k0.sizes() &&
                    k0.size(0) == B && k_caches[b].scalar_type() == dtype &&
                    v_caches[b].scalar_type() == dtype &&
                    attn_norms[b].scalar_type() == dtype &&
                    mlp_norms[b].scalar_type() == dtype && k_caches[b].is_contiguous() &&
                    v_caches[b].is_contiguous() && attn_norms[b].is_contiguous() &&
                    mlp_norms[b].is_contiguous() && attn_norms[b].numel() == z.C &&
                    mlp_norms[b].numel() == z.C,
                "blocks_step: block ", b, "'s caches or norms are not contiguous, of the "
                "first block's shape (a row for each of x's sequences; C values), in one dtype");
    check_block_products(products.slice(12 * b, 12), row_bits.slice(4 * b, 4), z);
  }
  const bool slot_a_row = slots.numel() == z.R && B > 1;
  TORCH_CHECK(cos.numel() == z.R * z.D && sin.numel() == z.R * z.D &&
                  mask.numel() == z.R * z.S && (slots.numel() == T || slot_a_row) &&
                  z.S <= z.capacity && z.S > 0,
              "blocks_step: the angles, mask or slots do not fit ", B, " x ", T, " rows over ",
              z.S, " of ", z.capacity, " slots");
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); t++)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < z.capacity, "blocks_step: slot ", slot[t],
                " is outside the cache's ", z.capacity);
  at::Tensor out = x.clone().view({z.R, z.C});  /* the residual stream */
  if (dtype == at::kFloat)
    blocks<float>(out.data_ptr<float>(), cos, sin, mask, k_caches, v_caches, slot, slot_a_row,
                  attn_norms, mlp_norms, products, row_bits, z, eps);
  else
    blocks<c10::BFloat16>(out.data_ptr<float>(), cos, sin, mask, k_caches, v_caches, slot,
                          slot_a_row, attn_norms, mlp_norms, products, row_bits, z, eps);
  return out.view({B, T, z.C});
}

/* ---- the Hydra heads' whole draft in one call (fused_draft.py): hydra.hydra_candidates is the
   reference, step for step. Per depth d = 1..D, head d reads, for each of the M nodes of depth
   d - 1 that have children, the embeddings of its path's d tokens (root .. the node) side by
   side: z = h + U (M, d C); then each residual block z + silu(W z + b); then the LM head's
   logits (M, V') and their top_k columns, which become the next depth's tokens. Every product
   is group_kernel.c's int8 one (the heads' layers and the LM head in 8-bit groups), every
   elementwise step computed in float32 and rounded to E once, as torch computes it in E: the
   same logits as the reference but for silu's exp (std::exp against torch's vectorised one,
   an ulp apart at most), so the same tokens but where two logits all but tie. Only the guesses
   could differ, never what is accepted: greedy Medusa stays lossless whatever they are. */

/* the top_k columns of row (V,), largest first (torch.topk's order where the values differ),
   of equal values the lower column first */
template <typename E>
void top_columns(const E* row, int64_t V, int64_t top_k, int64_t* out) {
  std::vector<float> best(top_k, -INFINITY);
  std::fill(out, out + top_k, 0);
  for (int64_t v = 0; v < V; v++) {
    const float x = wide(row[v]);
    if (!(x > best[top_k - 1])) continue;  /* not above the k-th (NaN never is) */
    int64_t i = top_k - 1;
    for (; i > 0 && x > best[i - 1]; i--) best[i] = best[i - 1], out[i] = out[i - 1];
    best[i] = x, out[i] = v;
  }
}

/* one Hydra head's depth: hidden (C,), the path embeddings x (M, d C) -> logits (M, V); heads'
   tensors for this head from `at`: read (packed, scales), then per block (packed, scales,
   bias) */
template <typename E>
void head_logits(const E* hidden, const E* x, at::TensorList heads, int64_t at, int64_t layers,
                 const at::Tensor& lm_packed, const at::Tensor& lm_scales, E* z, E* y,
                 E* logits, int64_t M, int64_t C, int64_t d, int64_t V) {
  const int f = std::is_same_v<E, float>;
  check(int8_product(x, heads[at].const_data_ptr<uint8_t>(), halves(heads[at + 1]), y, M, C,
                     d * C, f, 0), "its rows in float32");
  for (int64_t m = 0; m < M; m++)
    for (int64_t c = 0; c < C; c++)
      z[m * C + c] = narrow<E>(wide(hidden[c]) + wide(y[m * C + c]));
  for (int64_t l = 0; l < layers; l++) {
    const int64_t w = at + 2 + 3 * l;
    const E* bias = heads[w + 2].const_data_ptr<E>();
    check(int8_product(z, heads[w].const_data_ptr<uint8_t>(), halves(heads[w + 1]), y, M, C, C,
                       f, 0), "its rows in float32");
    for (int64_t m = 0; m < M; m++)
      for (int64_t c = 0; c < C; c++) {
        const float linear = wide(narrow<E>(wide(y[m * C + c]) + wide(bias[c])));
        const float silu = wide(narrow<E>(linear / (1.0f + std::exp(-linear))));
        z[m * C + c] = narrow<E>(wide(z[m * C + c]) + silu);
      }
  }
  check(int8_product(z, lm_packed.const_data_ptr<uint8_t>(), halves(lm_scales), logits, M, V, C,
                     f, 0), "its rows in float32");
}

/* the tree's tokens (N,), root first, filled in depth by depth: each parent's top_k columns,
   or, given noise (N, V) (Gumbel noise, a row a node), its top_k of logits / T + noise: top_k
   draws without replacement from softmax(logits / T), the logits kept in node_logits (N, V)
   and the draws' token ids, in order, in node_draws (N, top_k) */
template <typename E>
at::Tensor draft_tokens(const at::Tensor& hidden, int64_t root, const at::Tensor& ancestors,
                        at::TensorList drafting, const at::Tensor& embed, at::TensorList heads,
                        int64_t layers, const at::Tensor& lm_packed,
                        const at::Tensor& lm_scales, const at::Tensor& ids, int64_t top_k,
                        const float* noise = nullptr, float temperature = 1.0f,
                        E* node_logits = nullptr, int64_t* node_draws = nullptr) {
  const int64_t N = ancestors.size(0), width = ancestors.size(1), C = hidden.numel();
  const int64_t V = lm_scales.size(0) * 16, D = drafting.size() / 4, per_head = 2 + 3 * layers;
  at::Tensor tokens = at::full({N}, root, ancestors.options());
  int64_t* t = tokens.data_ptr<int64_t>();
  const int64_t* up = ancestors.const_data_ptr<int64_t>();
  const E *h = hidden.const_data_ptr<E>(), *table = embed.const_data_ptr<E>();
  const int64_t* column_id = ids.numel() ? ids.const_data_ptr<int64_t>() : nullptr;
  for (int64_t d = 1; d <= D; d++) {
    const at::Tensor &parents = drafting[4 * (d - 1)], &children = drafting[4 * (d - 1) + 1];
    const int64_t* p = parents.const_data_ptr<int64_t>();
    const int64_t* child = children.const_data_ptr<int64_t>();
    const int64_t* slot = drafting[4 * (d - 1) + 2].const_data_ptr<int64_t>();
    const int64_t* rank = drafting[4 * (d - 1) + 3].const_data_ptr<int64_t>();
    const int64_t M = parents.numel();
    const auto rows = hidden.options();
    at::Tensor x = at::empty({M, d * C}, rows), z = at::empty({M, C}, rows);
    at::Tensor y = at::empty({M, C}, rows), logits = at::empty({M, V}, rows);
    at::Tensor top = at::empty({M, top_k}, ancestors.options());
    E* xp = x.data_ptr<E>();
    for (int64_t m = 0; m < M; m++)  /* the path's tokens root .. parent, embedded side by side */
      for (int64_t j = 0; j < d; j++)
        std::memcpy(xp + (m * d + j) * C, table + t[up[p[m] * width + j]] * C, C * sizeof(E));
    head_logits<E>(h, xp, heads, (d - 1) * per_head, layers, lm_packed, lm_scales,
                   z.data_ptr<E>(), y.data_ptr<E>(), logits.data_ptr<E>(), M, C, d, V);
    int64_t* tp = top.data_ptr<int64_t>();
    std::vector<float> keys(noise ? V : 0);
    for (int64_t m = 0; m < M; m++) {
      const E* row = logits.const_data_ptr<E>() + m * V;
      if (noise == nullptr) {
        top_columns(row, V, top_k, tp + m * top_k);
        continue;
      }
      for (int64_t v = 0; v < V; v++) keys[v] = wide(row[v]) / temperature + noise[p[m] * V + v];
      top_columns(keys.data(), V, top_k, tp + m * top_k);
      std::memcpy(node_logits + p[m] * V, row, V * sizeof(E));
      for (int64_t j = 0; j < top_k; j++) {
        const int64_t column = tp[m * top_k + j];
        node_draws[p[m] * top_k + j] = column_id ? column_id[column] : column;
      }
    }
    for (int64_t c = 0; c < children.numel(); c++) {
      const int64_t column = tp[slot[c] * top_k + rank[c]];
      t[child[c]] = column_id ? column_id[column] : column;
    }
  }
  return tokens;
}

/* what hydra_draft and hydra_draw take fits together, checked before any pointer is read: the
   tensors' shapes, dtypes and layout, and every index the draft follows (the tree's ancestors
   and drafting order, the root, the vocabulary's ids) inside what it indexes. One error where
   not. */
void check_draft(const at::Tensor& hidden, int64_t root, const at::Tensor& ancestors,
                 at::TensorList drafting, const at::Tensor& embed, at::TensorList heads,
                 int64_t layers, const at::Tensor& lm_packed, const at::Tensor& lm_scales,
                 const at::Tensor& ids, int64_t top_k) {
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && hidden.dim() == 1 &&
                  embed.scalar_type() == dtype && embed.dim() == 2 &&
                  embed.size(1) == hidden.numel() && ancestors.scalar_type() == at::kLong &&
                  ancestors.dim() == 2 && drafting.size() % 4 == 0 && layers >= 0,
              "hydra_draft: the hidden state (C,) and the embeddings (vocab, C) in one dtype, "
              "float32 or bfloat16, the ancestors (N, depth) int64, 4 tensors a depth");
  const int64_t N = ancestors.size(0), width = ancestors.size(1), D = drafting.size() / 4;
  const int64_t C = hidden.numel(), V = lm_scales.dim() == 3 ? lm_scales.size(0) * 16 : 0;
  const int64_t vocab = embed.size(0), per_head = 2 + 3 * layers;
  TORCH_CHECK(width > D && top_k >= 1 && top_k <= V && root >= 0 && root < vocab &&
                  (int64_t)heads.size() >= D * per_head &&
                  (ids.numel() == 0 || (ids.numel() == V && ids.scalar_type() == at::kLong)),
              "hydra_draft: the tree, heads, top_k or root do not fit (", N, " nodes of depth ",
              width, ", ", D, " depths, top_k ", top_k, " of ", V, " columns, root ", root, ")");
  check_weight("hydra_draft", lm_packed, lm_scales, nullptr, 32, V, C);
  const int64_t* up = ancestors.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < N * width; i++)
    TORCH_CHECK(up[i] >= 0 && up[i] < N, "hydra_draft: an ancestor index ", up[i],
                " outside the tree's ", N, " nodes");
  if (ids.numel() != 0) {
    const int64_t* id = ids.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < V; i++)
      TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "hydra_draft: a draft vocabulary id ", id[i],
                  " outside the embeddings' ", vocab);
  } else {
    TORCH_CHECK(V <= vocab, "hydra_draft: ", V, " columns of logits, ", vocab, " embeddings");
  }
  for (int64_t d = 1; d <= D; d++) {
    const at::TensorList depth = drafting.slice(4 * (d - 1), 4);
    for (const at::Tensor& t : depth)
      TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1,
                  "hydra_draft: the drafting order is contiguous 1-D int64 tensors");
    const int64_t M = depth[0].numel(), children = depth[1].numel();
    TORCH_CHECK(depth[2].numel() == children && depth[3].numel() == children,
                "hydra_draft: depth ", d, "'s children, slots and ranks differ in number");
    const int64_t *p = depth[0].const_data_ptr<int64_t>(), *child = depth[1].const_data_ptr<int64_t>();
    const int64_t *slot = depth[2].const_data_ptr<int64_t>(), *rank = depth[3].const_data_ptr<int64_t>();
    for (int64_t m = 0; m < M; m++)
      TORCH_CHECK(p[m] >= 0 && p[m] < N, "hydra_draft: depth ", d, "'s parent ", p[m],
                  " outside the tree's ", N, " nodes");
    for (int64_t c = 0; c < children; c++)
      TORCH_CHECK(child[c] >= 0 && child[c] < N && slot[c] >= 0 && slot[c] < M &&
                      rank[c] >= 0 && rank[c] < top_k,
                  "hydra_draft: depth ", d, "'s child ", child[c], ", parent slot ", slot[c],
                  " or rank ", rank[c], " outside the tree");
    const int64_t at = (d - 1) * per_head;
    check_weight("hydra_draft", heads[at], heads[at + 1], nullptr, 32, C, d * C);
    for (int64_t l = 0; l < layers; l++) {
      const int64_t w = at + 2 + 3 * l;
      check_weight("hydra_draft", heads[w], heads[w + 1], nullptr, 32, C, C);
      TORCH_CHECK(heads[w + 2].scalar_type() == dtype && heads[w + 2].numel() == C &&
                      heads[w + 2].is_contiguous(),
                  "hydra_draft: a block's bias is contiguous (C,) in the heads' dtype");
    }
  }
}

/* hidden (C,) in the heads' dtype E (float32 or bfloat16), the root token, the tree's ancestors
   (N, D + 1) and drafting order (4 int64 tensors a depth: parents, children, slot, rank; tree.py),
   the embedding table (vocab, C) in E, the heads' layers (per head: read's packed and scales,
   then `layers` blocks' packed, scales and bias (C,) in E), the LM head's packed and scales (V'
   outputs), the draft vocabulary's token ids (V',), or none, and how many guesses a node keeps
   -> the tree's tokens (N,) */
at::Tensor hydra_draft_op(const at::Tensor& hidden_, int64_t root, const at::Tensor& ancestors_,
                          at::TensorList drafting, const at::Tensor& embed_, at::TensorList heads,
                          int64_t layers, const at::Tensor& lm_packed,
                          const at::Tensor& lm_scales, const at::Tensor& ids_, int64_t top_k) {
  const at::Tensor hidden = hidden_.contiguous(), ancestors = ancestors_.contiguous();
  const at::Tensor embed = embed_.contiguous(), ids = ids_.contiguous();
  check_draft(hidden, root, ancestors, drafting, embed, heads, layers, lm_packed, lm_scales, ids,
              top_k);
  if (hidden.scalar_type() == at::kFloat)
    return draft_tokens<float>(hidden, root, ancestors, drafting, embed, heads, layers,
                               lm_packed, lm_scales, ids, top_k);
  return draft_tokens<c10::BFloat16>(hidden, root, ancestors, drafting, embed, heads, layers,
                                     lm_packed, lm_scales, ids, top_k);
}

/* hydra_draft's draw: the same, with the Gumbel noise (N, V') float32 and the temperature ->
   (the tree's tokens (N,), each parent's logits (N, V') in the heads' dtype and its draws'
   token ids (N, top_k); other rows 0) */
std::tuple<at::Tensor, at::Tensor, at::Tensor> hydra_draw_op(
    const at::Tensor& hidden, int64_t root, const at::Tensor& ancestors, at::TensorList drafting,
    const at::Tensor& embed, at::TensorList heads, int64_t layers, const at::Tensor& lm_packed,
    const at::Tensor& lm_scales, const at::Tensor& ids, int64_t top_k, const at::Tensor& noise_,
    double temperature) {
  const at::Tensor h = hidden.contiguous(), up = ancestors.contiguous(), e = embed.contiguous();
  const at::Tensor i = ids.contiguous(), noise = noise_.contiguous();
  check_draft(h, root, up, drafting, e, heads, layers, lm_packed, lm_scales, i, top_k);
  const int64_t V = lm_scales.size(0) * 16;
  TORCH_CHECK(noise.scalar_type() == at::kFloat && noise.dim() == 2 &&
                  noise.size(0) == ancestors.size(0) && noise.size(1) == V && temperature > 0,
              "hydra_draw: the noise is float32 (N, V') and the temperature positive");
  at::Tensor logits = at::zeros({ancestors.size(0), V}, hidden.options());
  at::Tensor draws = at::zeros({ancestors.size(0), top_k}, ancestors.options());
  int64_t* d = draws.data_ptr<int64_t>();
  const float* g = noise.const_data_ptr<float>();
  const float t = static_cast<float>(temperature);
  if (hidden.scalar_type() == at::kFloat)
    return {draft_tokens<float>(h, root, up, drafting, e, heads, layers, lm_packed, lm_scales, i,
                                top_k, g, t, logits.data_ptr<float>(), d), logits, draws};
  return {draft_tokens<c10::BFloat16>(h, root, up, drafting, e, heads, layers, lm_packed,
                                      lm_scales, i, top_k, g, t,
                                      logits.data_ptr<c10::BFloat16>(), d), logits, draws};
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
  m.impl("blocks_step", TORCH_FN(blocks_op));
  m.impl("hydra_draft", TORCH_FN(hydra_draft_op));
  m.impl("hydra_draw", TORCH_FN(hydra_draw_op));
}
