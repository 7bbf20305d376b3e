"""The Hydra heads' draft in ONE call of a C++ operator (draft_operator.cpp's hydra_draft), instead of
~25 operators a depth: heads.hydra_candidates is the reference, and stays what training,
calibration and any other heads run.

Why: a Hydra draft of one depth is 4 small products (the head's read U, its 2 residual blocks,
the draft vocabulary's LM head: ~1.9 MB of 8-bit weights) inside ~25 torch operators (the
path's embeddings, the broadcast, the bias adds, silu, topk, the token ids, the scatter), each
~10-20 us of Python and dispatch on a 2-core CPU. Measured in situ on the 2-core AVX2 EPYC
(Zen 3), the default model's w4a8 decoding: hydra_candidates took 0.76-0.89 ms a step, most of
them 1-node trees (one depth), where the products alone took ~0.17 ms; a plain step is ~12 ms.

Same tokens as the reference (tests/test_fused_draft.py) but where two logits all but tie: the
operator computes each elementwise step as torch does in the heads' dtype, except silu's exp
(std::exp, an ulp from torch's). Only the guesses could differ there, never what the model
accepts: greedy Medusa stays lossless whatever the draft.

Where: Hydra (and Hydra++) heads whose layers and LM head (or the draft vocabulary's cut of it)
are group_kernel.c's 8-bit groups (quantized.Int8GroupLinear: the int4 and w4a8 formats, where
the kernel multiplies), their activations in a dtype it takes, in inference mode.

Shapes: C model dim, N tree nodes, D depth, V' the heads' vocabulary.
"""
import torch

from minimedusa.draft import Candidates, TreeDraft
from minimedusa.heads import HydraHeads, drafting_lm_head
from minimedusa.speed import group_kernel
from minimedusa.speed.graphed_draft import GraphedDraft
from minimedusa.speed.packed_linear import OPERATORS
from minimedusa.speed.quantized import Int8GroupLinear
from minimedusa.speculative_sampling import DrawnDraft, proposal_from, proposal_q, step_noise
from minimedusa.tree import MedusaTree

# hidden (C,), root, the tree's ancestors (N, D + 1) and drafting order (4 tensors a depth), the
# embedding table, the heads' tensors (per head: read's packed and scales, then per block
# packed, scales, bias), blocks a head, the LM head's packed and scales, the draft vocabulary's
# ids (or an empty tensor), guesses kept a node -> tokens (N,)
OPERATORS.define("hydra_draft(Tensor hidden, int root, Tensor ancestors, Tensor[] drafting, "
                 "Tensor embed, Tensor[] heads, int layers, Tensor lm_packed, Tensor lm_scales, "
                 "Tensor ids, int top_k) -> Tensor")


@torch.library.register_fake("minimedusa::hydra_draft")
def _(hidden, root, ancestors, drafting, embed, heads, layers, lm_packed, lm_scales, ids, top_k):
    return ancestors.new_empty(ancestors.shape[0])


# the same, drawing: with Gumbel noise (N, V') float32 and the temperature -> (tokens (N,),
# each parent's logits (N, V'), its draws' token ids (N, top_k))
OPERATORS.define("hydra_draw(Tensor hidden, int root, Tensor ancestors, Tensor[] drafting, "
                 "Tensor embed, Tensor[] heads, int layers, Tensor lm_packed, Tensor lm_scales, "
                 "Tensor ids, int top_k, Tensor noise, float temperature) "
                 "-> (Tensor, Tensor, Tensor)")


@torch.library.register_fake("minimedusa::hydra_draw")
def _(hidden, root, ancestors, drafting, embed, heads, layers, lm_packed, lm_scales, ids, top_k,
      noise, temperature):
    n = ancestors.shape[0]
    return (ancestors.new_empty(n), hidden.new_empty(n, noise.shape[1]),
            ancestors.new_empty(n, top_k))


def fusable_draft(heads, model) -> str | None:
    """None if the heads' draft can run as one hydra_draft call, else why not, in words."""
    if not isinstance(heads, HydraHeads):
        return "they are not Hydra heads (Medusa heads guess every depth in one call already)"
    lm_head = drafting_lm_head(heads.vocabulary, model.lm_head)
    blocks = [block.linear for head in heads.heads for block in head.blocks]
    layers = [head.read for head in heads.heads] + blocks
    if not all(type(layer) is Int8GroupLinear for layer in layers + [lm_head]):
        return "their layers or LM head are not group_kernel.c's 8-bit groups"
    if lm_head.bias is not None or any(layer.bias is None for layer in blocks):
        return "their LM head has a bias, or a block has none"
    dtype = blocks[0].bias.dtype if blocks else None  # the heads' activations
    if dtype not in (torch.float32, torch.bfloat16) or model.embed.weight.dtype != dtype:
        return "their activations are not float32 or bfloat16, or not the embeddings' dtype"
    if dtype == torch.float32 and not group_kernel.takes_float32():
        return "their activations are float32, which this CPU's group_kernel.c does not multiply"
    return None


class FusedHydraDraft(TreeDraft):
    """TreeDraft whose tokens come from hydra_candidates as one operator call: the tensors it
    passes are read once here (through the modules they take ~8 us a call). Swapped in for the
    TreeDraft of these heads (fast_draft), as the fused blocks are for the model's."""

    def __init__(self, heads: HydraHeads, trees: dict[int, MedusaTree], model,
                 rank: dict | None = None):
        super().__init__(heads, trees, rank)
        lm_head = drafting_lm_head(heads.vocabulary, model.lm_head)
        self.head_tensors = [t for head in heads.heads for t in (
            head.read.packed, head.read.scales,
            *(t for b in head.blocks for t in (b.linear.packed, b.linear.scales, b.linear.bias)))]
        self.layers = len(heads.heads[0].blocks)
        self.lm = (lm_head.packed, lm_head.scales)
        vocabulary = heads.vocabulary
        self.ids = vocabulary.ids if vocabulary is not None else torch.empty(0, dtype=torch.long)
        self.embed = model.embed.weight

    def tree(self, model, n: int, root: int, features: torch.Tensor):
        tree = self.trees[n]
        with torch.inference_mode():
            tokens = torch.ops.minimedusa.hydra_draft(*self.arguments(tree, root, features))
        return Candidates(tree, tokens, self.rank)

    def arguments(self, tree: MedusaTree, root: int, features: torch.Tensor) -> tuple:
        drafting = [t for depth in tree.drafting for t in depth]
        return (features, root, tree.ancestors, drafting, self.embed, self.head_tensors,
                self.layers, *self.lm, self.ids, tree.top_k)


class FusedDrawnDraft(DrawnDraft):
    """DrawnDraft of Hydra heads, its draws in one hydra_draw call: the same noise (step_noise,
    from the same generator) and keys (logits / T + noise) as DrawnDraft's, so the same seed
    draws the same candidates; each parent's logits back for q."""

    def __init__(self, draft: DrawnDraft, model):
        super().__init__(draft.heads, draft.trees, draft.temperature, draft.seed, draft.rank)
        self.fused = FusedHydraDraft(draft.heads, draft.trees, model, draft.rank)
        # hydra_draw gives its draws as token ids; the Proposal wants the columns of q
        vocabulary, V = draft.heads.vocabulary, model.embed.weight.shape[0]
        self.column_of = torch.arange(V)  # token id -> column of q
        if vocabulary is not None:
            self.column_of[vocabulary.ids.cpu()] = torch.arange(len(vocabulary.ids))

    def tree(self, model, n: int, root: int, features: torch.Tensor):
        tree = self.trees[n]
        columns = self.fused.lm[1].shape[0] * 16  # V': the LM head's outputs, 16 a block
        noise = step_noise(self.heads, tree, columns, self.generator_on(features.device),
                           features.device)  # (N, V'): a row for each node's children
        with torch.inference_mode():
            tokens, logits, draws = torch.ops.minimedusa.hydra_draw(
                *self.fused.arguments(tree, root, features), noise, self.temperature)
        parents = sorted({p for parents, *_ in tree.drafting for p in parents.tolist()})
        q = torch.softmax(logits[parents].float() / self.temperature, dim=-1)  # (M, V')
        proposal = proposal_from([(tree.nodes[p], q[i], self.column_of[draws[p]])
                                  for i, p in enumerate(parents)], self.heads)
        return Candidates(tree, tokens, self.rank, proposal,
                          q=lambda: proposal_q(tree, tokens, proposal))


def fast_draft(draft, model):
    """The draft to decode with: a TreeDraft (or DrawnDraft) of Hydra heads whose draft fuses
    (fusable_draft) swapped for a FusedHydraDraft (FusedDrawnDraft), on a CPU; on CUDA a
    TreeDraft for a GraphedDraft (its trees' drafts as CUDA graphs, while the model's blocks
    are); any other as it is."""
    if model.embed.weight.device.type == "cuda" and type(draft) is TreeDraft:
        return GraphedDraft(draft.heads, draft.trees, draft.rank)
    if (model.embed.weight.device.type != "cpu" or type(draft) not in (TreeDraft, DrawnDraft)
            or fusable_draft(draft.heads, model) is not None):
        return draft
    if type(draft) is DrawnDraft:
        return FusedDrawnDraft(draft, model)
    return FusedHydraDraft(draft.heads, draft.trees, model, draft.rank)
