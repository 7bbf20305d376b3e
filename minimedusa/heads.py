"""Medusa heads (paper section 1): K extra heads on the backbone's last hidden state.

Head k (k = 1..K) reads h_t, the hidden state at position t after the final norm, and predicts
token t+k+1 (the backbone's own LM head predicts t+1):

    p_t^(k) = softmax( W2^(k) · ( SiLU(W1^(k) · h_t + b1^(k)) + h_t ) )

with L residual blocks stacked before W2. Two parametrisations of W2: each head's own V×d
projection, initialised as a copy of the LM head (the paper's form, the reference's "V1"
checkpoints), or the backbone's LM head shared by every head (the reference's "V2").
Their files (the reference's layout, so heads move between projects) are files/heads_files.py's.
Hydra's heads, which also read the draft's tokens, are in hydra.py; both kinds draft over a draft
vocabulary (DraftVocabulary, below), a cut of the shared LM head.

Shapes: B batch, T tokens, C model dim, V vocab (V' a draft vocabulary's), K heads.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MedusaConfig:
    """The heads' config.json, for both kinds: the paper's heads and Hydra's (hydra.py)."""
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
        self.vocabulary = None  # a DraftVocabulary, set for decoding (cli/draft_heads.py)

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
