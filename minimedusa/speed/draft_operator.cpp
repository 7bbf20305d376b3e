/* ::hydra_draft and ::hydra_draw, the Hydra heads' whole draft in one call (fused_draft.py):
   heads.hydra_candidates is the reference, step for step. Per depth d = 1..D, head d reads, for each of the M nodes of depth
   d - 1 that have children, the embeddings of its path's d tokens (root .. the node) side by
   side: z = h + U (M, d C); then each residual block z + silu(W z + b); then the LM head's
   logits (M, V') and their top_k columns, which become the next depth's tokens. Every product
   is group_kernel.c's int8 one (the heads' layers and the LM head in 8-bit groups), every
   elementwise step computed in float32 and rounded to E once, as torch computes it in E: the
   same logits as the reference but for silu's exp (std::exp against torch's vectorised one,
   an ulp apart at most), so the same tokens but where two logits all but tie. Only the guesses
   could differ, never what is accepted: greedy Medusa stays lossless whatever they are. */
#include "operators.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

namespace {

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
  m.impl("hydra_draft", TORCH_FN(hydra_draft_op));
  m.impl("hydra_draw", TORCH_FN(hydra_draw_op));
}
