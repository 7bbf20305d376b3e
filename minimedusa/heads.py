"""Medusa heads (paper section 1): K extra heads on the backbone's last hidden state.

Head k (k = 1..K) reads h_t, the hidden state at position t after the final norm, and predicts
token t+k+1 (the backbone's own LM head predicts t+1):

    p_t^(k) = softmax( W2^(k) · ( SiLU(W1^(k) · h_t + b1^(k)) + h_t ) )

with L residual blocks stacked before W2. Two parametrisations of W2: each head's own V×d
projection, initialised as a copy of the LM head (the paper's form, the reference's "V1"
checkpoints), or the backbone's LM head shared by every head (the reference's "V2").
Their files (the reference's layout, so heads move between projects) are files/heads_files.py's.
Hydra's heads, which also read the draft's tokens, are below them (HydraHeads); both kinds draft
over a draft vocabulary (DraftVocabulary, below), a cut of the shared LM head.

Shapes: B batch, T tokens, C model dim, V vocab (V' a draft vocabulary's), K heads.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimedusa.tree import MedusaTree


@dataclass
class MedusaConfig:
    """The heads' config.json, for both kinds: the paper's heads and Hydra's (HydraHeads)."""
    medusa_num_heads: int  # K
    medusa_num_layers: int  # L residual blocks per head
    hidden_size: int  # C: must equal the backbone's
    vocab_size: int  # V: must equal the backbone's
    shared_lm_head: bool = False  # True: heads reuse the backbone's LM head (no own W2)
    head_kind: str = "medusa"  # "medusa": head k reads h_t; "hydra": also the draft's tokens


class ResBlock(nn.Module):
    """x + SiLU(W1 x + b1); W1 = 0 and b1 = 0 at init, so the block starts as the identity."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):  # (..., C) -> (..., C)
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.config = cfg

        def head():  # L blocks, then (own form only) W2: its index L gives the key {i}.{L}.weight
            blocks = [ResBlock(cfg.hidden_size) for _ in range(cfg.medusa_num_layers)]
            if not cfg.shared_lm_head:
                blocks.append(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
            return nn.Sequential(*blocks)

        # note: a comprehension, not [head()] * K, which would repeat ONE head K times.
        self.heads = nn.ModuleList([head() for _ in range(cfg.medusa_num_heads)])
        self.vocabulary = None  # a DraftVocabulary, set for decoding (assembly/heads_reading.py)

    @classmethod
    def for_model(cls, model, num_heads: int, num_layers: int = 1,
                  shared_lm_head: bool = False) -> "MedusaHeads":
        """Fresh heads in the paper's initialisation: every head predicts exactly what the LM
        head predicts at step 0 (identity blocks, W2 = a copy of the LM head)."""
        cfg = MedusaConfig(num_heads, num_layers, model.config.hidden_size,
                           model.config.vocab_size, shared_lm_head)
        heads = cls(cfg).to(device=model.lm_head.weight.device, dtype=model.lm_head.weight.dtype)
        if not shared_lm_head:
            with torch.no_grad():
                for head in heads.heads:
                    head[-1].weight.copy_(model.lm_head.weight)
        return heads

    def forward(self, hidden: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """Logits of every head: hidden (..., C) -> (K, ..., V).

        lm_head is the backbone's, passed explicitly: the shared form projects with it, the own
        form ignores it (its W2 is the last module of each head).
        """
        if self.config.shared_lm_head:
            # one (K, ..., C) @ (C, V) product: the V x C weight is read from memory once, not K
            # times, which is what makes this form cheap on bandwidth-bound hardware
            return lm_head(torch.stack([head(hidden) for head in self.heads]))
        return torch.stack([head(hidden) for head in self.heads])


class DraftVocabulary(nn.Module):
    """The shared LM head cut to the V' tokens the heads may guess (FR-Spec, EAGLE-3's draft
    vocabulary): the V' most frequent tokens of the self-distilled answers.

    Drafting reads V' rows of the V x C LM head instead of all V, the heads' biggest cost on a
    CPU; the backbone still verifies over the whole vocabulary, so the output never changes: a
    token outside V' is only never guessed. Logits (..., V') rank columns; ids maps a column
    back to its token id.
    """

    def __init__(self, ids: torch.Tensor, lm_head: nn.Linear):
        super().__init__()
        # read once: a quantized LM head computes its weight on each read (speed/quantized.py)
        weight = lm_head.weight  # (V, C): lm_head may be a PackedLinear or an Int8GroupLinear
        self.vocab_size, dim = weight.shape
        self.register_buffer("ids", ids.to(weight.device))  # (V',) int64
        self.lm_head = nn.Linear(dim, len(ids), bias=False, device=weight.device,
                                 dtype=weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight[self.ids])  # (V', C): the kept rows
        self.requires_grad_(False)  # the backbone's LM head, frozen as it is


def as_features(heads: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Hidden states (..., C) as the heads read them: in the dtype of the heads' weights.

    The one place that decides it, for training, calibration and decoding alike: a weight
    format casts the heads (speed/weight_formats.apply_format: bfloat16, or int4's bfloat16 heads),
    while the states they are given may come in another dtype (rows stored in bfloat16, a
    float32 training backbone, a quantized LM head whose weight reads as float32)."""
    return hidden.to(next(heads.parameters()).dtype)


def drafting_lm_head(vocabulary: DraftVocabulary | None, lm_head: nn.Module) -> nn.Module:
    """What the heads project with: the draft vocabulary's cut of the LM head, or all of it."""
    return lm_head if vocabulary is None else vocabulary.lm_head


def token_ids(vocabulary: DraftVocabulary | None, columns: torch.Tensor) -> torch.Tensor:
    """Columns of the heads' logits -> token ids (the same, without a draft vocabulary)."""
    return columns if vocabulary is None else vocabulary.ids[columns]


def ranked_vocab_size(heads: nn.Module, model) -> int:
    """How many tokens the heads (Medusa's or Hydra's) rank: their draft vocabulary's, else
    the model's whole vocabulary."""
    vocabulary = heads.vocabulary
    return model.config.vocab_size if vocabulary is None else vocabulary.ids.numel()


def token_ranking(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(every token id that occurs in `tokens`, most frequent first (ties: the smaller id);
    its count): a draft vocabulary of V' tokens is the first V' ids."""
    counts = torch.bincount(tokens)
    ids = counts.argsort(descending=True, stable=True)
    ids = ids[counts[ids] > 0]
    return ids, counts[ids]


# Hydra heads (Ankner et al., 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa
# Decoding"): Medusa heads that see the draft.
#
# A Medusa head k guesses token t+k+1 from h_t alone: it never sees the root token t+1, which the
# backbone has already chosen exactly when the heads run, nor the guesses of the heads before it.
# A Hydra head k also reads the input embeddings of the tokens on its path: the root x_{t+1} and
# the candidates x_{t+2}, ..., x_{t+k} at depths 1..k-1:
#
#     z^(k) = h_t + U^(k) · [E(x_{t+1}); ...; E(x_{t+k})]        (U^(k): C x kC)
#     p^(k) = softmax( W_lm · Blocks^(k)(z^(k)) )
#
# E is the backbone's input embedding and W_lm its LM head, both frozen and shared by every head;
# Blocks^(k) are L residual blocks, as in a Medusa head (above). U^(k) starts at zero, so a fresh
# Hydra head is exactly a fresh shared-projection Medusa head: training only adds what the tokens
# tell. The price: head k needs the candidates of depth k-1, so drafting a tree runs depth by
# depth, one batched head call per depth over the nodes of the previous depth (hydra_candidates),
# where the Medusa heads make one call for every depth. Training stays one call per batch:
# teacher forcing feeds each head the true answer tokens, which is what a correct draft holds.
#
# Shapes: B rows, C model dim, V vocab (V' with a draft vocabulary), K heads, k a head's depth
# (1..K), N tree nodes, M nodes that have children at one depth.


class HydraHead(nn.Module):
    """Head k: z = h + U [E(x_1); ...; E(x_k)], then L residual blocks (the LM head is shared)."""

    def __init__(self, depth: int, dim: int, num_layers: int):
        super().__init__()
        self.read = nn.Linear(depth * dim, dim, bias=False)  # U^(k)
        nn.init.zeros_(self.read.weight)  # the token part starts at zero: a Medusa head
        self.blocks = nn.Sequential(*[ResBlock(dim) for _ in range(num_layers)])

    def forward(self, hidden, path_embeddings):  # (..., C), (..., k * C) -> (..., C)
        return self.blocks(hidden + self.read(path_embeddings))


class HydraHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        assert cfg.head_kind in ("hydra", "hydra++") and cfg.shared_lm_head
        self.config = cfg
        self.heads = nn.ModuleList([HydraHead(k, cfg.hidden_size, cfg.medusa_num_layers)
                                    for k in range(1, cfg.medusa_num_heads + 1)])
        self.vocabulary = None  # a DraftVocabulary, set for decoding (assembly/heads_reading.py)

    @classmethod
    def for_model(cls, model, num_heads: int, num_layers: int = 1) -> "HydraHeads":
        """Fresh heads: each predicts exactly what the LM head predicts at step 0."""
        cfg = MedusaConfig(num_heads, num_layers, model.config.hidden_size,
                           model.config.vocab_size, shared_lm_head=True, head_kind="hydra")
        weight = model.lm_head.weight
        return cls(cfg).to(device=weight.device, dtype=weight.dtype)

    def head(self, k: int, hidden: torch.Tensor, path: torch.Tensor, embed: nn.Embedding,
             lm_head: nn.Module) -> torch.Tensor:
        """Head k's logits: hidden (..., C) (broadcast over the rows of path), path (..., k)
        token ids x_{t+1}..x_{t+k} -> (..., V)."""
        emb = embed(path).flatten(-2)  # (..., k * C): the k embeddings side by side
        return lm_head(self.heads[k - 1](hidden.expand(*emb.shape[:-1], -1), emb))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, embed: nn.Embedding,
                lm_head: nn.Module) -> torch.Tensor:
        """Every head's logits, teacher-forced: hidden (B, C), tokens (B, K) = the answer's
        x_{t+1}..x_{t+K} -> (K, B, V). Head k reads tokens[:, :k]."""
        return torch.stack([self.head(k, hidden, tokens[:, :k], embed, lm_head)
                            for k in range(1, len(self.heads) + 1)])


@torch.inference_mode()
def hydra_candidates(heads: HydraHeads, model, hidden: torch.Tensor, root: torch.Tensor,
                     tree: MedusaTree, pick=None) -> torch.Tensor:
    """The tree's tokens (N,), drafted depth by depth from h_t (C,) and the root token ().

    At depth d, head d runs once over the M nodes of depth d-1 that have children, each reading
    its own path's tokens; node p + (r,) gets the r-th best guess at its parent p (among the
    heads' draft vocabulary, if they have one). `pick(logits, k)`: the k guesses' columns,
    (M, V') -> (M, top_k), best first (default: the top k; speculative_sampling.py draws them)."""
    lm_head = drafting_lm_head(heads.vocabulary, model.lm_head)
    tokens = root.reshape(1).expand(tree.size).clone()  # (N,): filled in depth by depth
    for d in range(1, tree.num_heads + 1):
        parents, children, slot, rank = tree.drafting[d - 1]
        path = tokens[tree.ancestors[parents, :d]]  # (M, d): root .. parent
        logits = heads.head(d, hidden, path, model.embed, lm_head)  # (M, V')
        columns = logits.topk(tree.top_k, dim=-1).indices if pick is None else pick(logits,
                                                                                    tree.top_k)
        top = token_ids(heads.vocabulary, columns)  # (M, top_k)
        tokens[children] = top[slot, rank]
    return tokens
