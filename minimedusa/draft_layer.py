"""A draft layer that reads the accepted context: Hydra++ (Ankner et al., 2024, section 5).

Medusa and Hydra heads see the sequence only through h_t, the backbone's last hidden state at
the last accepted token. Hydra++ puts one more decoder layer in front of the heads: a causal
block of the backbone's own shape (attention + SwiGLU, RoPE), run over the backbone's final
hidden states of the whole accepted sequence, with its own KV cache:

    f_1..f_t = DraftLayer(h_1..h_t)             (causal: f_t reads h_1..h_t)
    z^(k)   = f_t + U^(k) [E(x_{t+1}); ...; E(x_{t+k})]      (Hydra's head k, hydra.py)

so a head's input carries what the sequence said before t, not only what h_t kept of it. The
layer's two output projections start at zero: a fresh layer passes h_t through unchanged, and a
fresh Hydra++ draft is exactly a fresh Hydra draft. It may also learn from the backbone's whole
next-token distribution instead of the data's one token (Hydra++'s teacher loss: train.py
--distill, training.distill_loss).

Its cache only ever holds accepted positions: after each forward of the backbone the layer
reads the hidden states of the positions that forward kept (the prompt, a plain step's token,
or a tree's accepted nodes), in order. So no compaction is needed: its length always equals the
backbone cache's, and it equals a fresh prefill of the accepted sequence (a test checks it).
The price: one block's forward over the accepted tokens per step (1 to ~5 rows), beside the 30
blocks of the backbone.

Training runs the layer over whole answers: the backbone's states at the prompt (computed once,
prompt_states) followed by those stored with the answer, which the layer reads at the same
positions as in decoding. A step draws its rows from ANSWERS_PER_BATCH answers: the heads then
learn on rows about as varied as Hydra's shuffled ones (measured: a step of the 256 rows of
2 whole answers reached top-1 0.33 at step 500 where shuffled rows reached 0.43), while the
layer reads 8 answers, ~1,500 positions, a step.

Shapes: B answers, T positions, C model dim, K heads, M answer positions (rows), V vocab.
"""
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from minimedusa.heads import MedusaConfig
from minimedusa.hydra import HydraHeads
from minimedusa.kv_cache import KVCache
from minimedusa.model import Block, LlamaConfig, causal_mask, rope_angles, rope_frequencies
from minimedusa.training import Rows, batch_rows, rows_of


class DraftLayer(nn.Module):
    """One causal decoder block of the backbone's shape, over its final hidden states."""

    def __init__(self, model_config: LlamaConfig):
        super().__init__()
        self.config = replace(model_config, num_hidden_layers=1)
        self.block = Block(self.config)
        nn.init.zeros_(self.block.attn.wo.weight)  # both branches add zero: f = h at first
        nn.init.zeros_(self.block.mlp.down.weight)

    def forward(self, hidden, positions, mask, cache: KVCache | None = None, slots=None):
        """hidden (B, T, C) at positions (B, T); mask (B, T, S) bool as the backbone's ->
        (B, T, C). With a cache, the T states' keys/values go to `slots` (T,)."""
        cos, sin = rope_angles(positions, rope_frequencies(self.config, positions.device))
        layer_cache = cache.layers[0] if cache is not None else None
        return self.block(hidden, cos, sin, mask.unsqueeze(1), layer_cache, slots)


class HydraPlusPlusHeads(HydraHeads):
    """Hydra heads that read the draft layer's f_t in place of h_t (files: head_kind "hydra++",
    the layer's tensors under draft_layer.*)."""

    def __init__(self, cfg: MedusaConfig, model_config: LlamaConfig):
        super().__init__(cfg)
        self.draft_layer = DraftLayer(model_config)

    @classmethod
    def for_model(cls, model, num_heads: int, num_layers: int = 1) -> "HydraPlusPlusHeads":
        cfg = MedusaConfig(num_heads, num_layers, model.config.hidden_size,
                           model.config.vocab_size, shared_lm_head=True, head_kind="hydra++")
        weight = model.lm_head.weight
        return cls(cfg, model.config).to(device=weight.device, dtype=weight.dtype)


# --- decoding: the layer's cache follows the accepted sequence --------------------------------

def new_draft_cache(heads: HydraPlusPlusHeads, capacity: int) -> KVCache:
    """An empty one-layer cache for the draft layer, as long as the backbone's."""
    # the norm's weight: never swapped by a weight format (a packed layer may let its weight go)
    cfg, weight = heads.draft_layer.config, heads.draft_layer.block.attn_norm.weight
    return KVCache(1, 1, cfg.num_key_value_heads, capacity, cfg.head_dim, weight.device,
                   weight.dtype)


@torch.inference_mode()
def read_accepted(heads: HydraPlusPlusHeads, cache: KVCache, hidden: torch.Tensor) -> torch.Tensor:
    """Feed the draft layer the backbone's states (a, C) of the a positions just accepted (they
    follow the cache's); returns f (C,) at the last one: what the heads read next."""
    n, a = cache.length, hidden.shape[0]
    positions = torch.arange(n, n + a, device=hidden.device).unsqueeze(0)  # (1, a)
    out = heads.draft_layer(hidden.unsqueeze(0), positions, causal_mask(n, a, hidden.device),
                            cache, cache.next_slots(a))  # (1, a, C)
    cache.advance(a)
    return out[0, -1]


# --- training: whole answers through the layer ---------------------------------------------------

@torch.no_grad()
def prompt_states(model, prompts: list[torch.Tensor], device) -> list[torch.Tensor]:
    """The backbone's final hidden states at each prompt's positions but the last, (p - 1, C)
    each (bf16, as the stored answer states): the last position's state is the answer's row 0,
    stored with the data already."""
    states = []
    for p in prompts:
        ids = p[:-1].to(device).unsqueeze(0)  # (1, p - 1)
        T = ids.shape[1]
        if T == 0:  # a one-token prompt: its only state is the answer's row 0
            states.append(torch.zeros(0, model.config.hidden_size, dtype=torch.bfloat16))
            continue
        positions = torch.arange(T, device=device).unsqueeze(0)
        with torch.compiler.set_stance("force_eager"):  # a new length each prompt: never compile
            hidden = model.hidden_states(ids, positions, causal_mask(0, T, device))[0]
        states.append(hidden.to(torch.bfloat16).cpu())
    return states


# answers a training step draws its rows from (each read whole by the layer)
ANSWERS_PER_BATCH = 8


@dataclass
class AnswerRows:
    """Medusa-1's rows (training.Rows, answer after answer), with what the draft layer reads
    before each answer: the prompt's states. Answer j's rows are rows[offsets[j]:offsets[j+1]]."""
    rows: Rows
    prompts: list[torch.Tensor]  # (p_j - 1, C) bf16 each
    offsets: torch.Tensor  # (answers + 1,) int64

    def __len__(self) -> int:
        return len(self.prompts)

    def row_index(self, answers: torch.Tensor) -> torch.Tensor:
        """The rows (M,) of the given answers (increasing), answer after answer."""
        return torch.cat([torch.arange(self.offsets[j], self.offsets[j + 1])
                          for j in answers.tolist()])

    def sample_rows(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        """Step `step`'s rows (B,), increasing: batch_size drawn at random from the rows of
        ANSWERS_PER_BATCH answers (answers in a fresh order each pass over them, as
        training.batch_rows orders rows); fixed by the step, so a resumed run draws the same."""
        answers = batch_rows(len(self), step, min(ANSWERS_PER_BATCH, len(self)), seed).sort()
        rows = self.row_index(answers.values)
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return rows[torch.randperm(len(rows), generator=g)[:batch_size].sort().values]

    def features_at(self, layer: DraftLayer, index: torch.Tensor, device) -> torch.Tensor:
        """The layer's output f at rows `index` (M,) (increasing), (M, C): it reads each of the
        rows' answers whole."""
        answers = torch.searchsorted(self.offsets, index, right=True) - 1  # (M,)
        answers = answers.unique()  # sorted
        features = layer_features(layer, self, answers, device)  # every row of those answers
        return features[torch.searchsorted(self.row_index(answers).to(features.device),
                                           index.to(features.device))]


def answer_rows(model, answers: list[tuple], num_heads: int, device) -> AnswerRows:
    """answers (prompt ids, answer ids, hidden) as rows with their prompts' states."""
    offsets = torch.tensor([0] + [len(a) for _, a, _ in answers]).cumsum(0)
    return AnswerRows(rows_of(answers, num_heads), prompt_states(model, [p for p, _, _ in answers],
                                                                 device), offsets)


def layer_features(layer: DraftLayer, data: AnswerRows, answers: torch.Tensor,
                   device) -> torch.Tensor:
    """f at every row of the given answers (M, C), in the layer's dtype: each answer's sequence
    (its prompt's states, then its rows' stored states) through the layer, padded at the end
    (causal: padding is never read)."""
    seqs = [torch.cat([data.prompts[j], data.rows.hidden[data.offsets[j]:data.offsets[j + 1]]])
            for j in answers.tolist()]
    B, T = len(seqs), max(len(s) for s in seqs)
    hidden = torch.zeros(B, T, seqs[0].shape[1], dtype=layer.block.attn_norm.weight.dtype)
    for b, s in enumerate(seqs):
        hidden[b, :len(s)] = s
    positions = torch.arange(T, device=device).expand(B, T)
    out = layer(hidden.to(device), positions, causal_mask(0, T, device).expand(B, T, T))
    return torch.cat([out[b, len(data.prompts[j]):len(s)]
                      for b, (j, s) in enumerate(zip(answers.tolist(), seqs))])


@torch.no_grad()
def featured_rows(heads: HydraPlusPlusHeads, data: AnswerRows, device,
                  answers_per_batch: int = 16) -> Rows:
    """The rows with f_t in place of h_t: what evaluation and calibration read (then the heads
    are Hydra heads)."""
    features = [layer_features(heads.draft_layer, data, torch.arange(a, min(a + answers_per_batch,
                                                                            len(data))), device)
                .cpu() for a in range(0, len(data), answers_per_batch)]
    return Rows(torch.cat(features), data.rows.targets, data.rows.tokens)
