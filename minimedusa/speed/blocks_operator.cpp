/* ::blocks_step, all the blocks in one call (fused_block.py): the decoding step's transformer
   blocks of a model whose products are group_kernel.c's int4 (or w4a8) layers. model.Block is the reference:
   x + attn(norm(x)), then + mlp(norm(.)), each elementwise step below a loop over one row at a
   time, so that a row's bits depend on nothing beside it (the products' and the attention's own
   property): greedy Medusa stays lossless with respect to plain decoding.
   E is the activations' dtype (the products' rows, the cache, the norms' weights): float32 (the
   AVX2 path's) or bfloat16 (the AVX-512 BF16 path's). As model.py computes a bfloat16 block,
   the residual stream stays float32, each step computes in float32 and rounds its result to E
   once (the norm also before its weight, as RMSNorm casts first; SwiGLU after silu).
   Shapes: B sequences, T rows each, C model dim, H query heads, G key/value heads, D head dim,
   S attended slots, I the MLP's inner dim. */
#include "operators.h"

#include <ATen/ops/empty.h>

namespace {

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

}  // namespace

TORCH_LIBRARY_IMPL(minimedusa, CPU, m) { m.impl("blocks_step", TORCH_FN(blocks_op)); }
