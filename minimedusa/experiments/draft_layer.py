"""A draft layer that reads the accepted context: Hydra++ (Ankner et al., 2024, section 5).
Measured, not shipped (weights/RESULTS.md): an experiment beside the core, which never imports
it; its draft (PlusPlusDraft) is handed to the decoding loop like any other.

Medusa and Hydra heads see the sequence only through h_t, the backbone's last hidden state at
the last accepted token. Hydra++ puts one more decoder layer in front of the heads: a causal
block of the backbone's own shape (attention + SwiGLU, RoPE), run over the backbone's final
hidden states of the whole accepted sequence, with its own KV cache:

    f_1..f_t = DraftLayer(h_1..h_t)             (causal: f_t reads h_1..h_t)
    z^(k)   = f_t + U^(k) [E(x_{t+1}); ...; E(x_{t+k})]      (Hydra's head k, heads.py)

so a head's input carries what the sequence said before t, not only what h_t kept of it. The
layer's two output projections start at zero: a fresh layer passes h_t through unchanged, and a
fresh Hydra++ draft is exactly a fresh Hydra draft. It may also learn from the backbone's whole
next-token distribution instead of the data's one token (Hydra++'s teacher loss: train.py
--distill, training/medusa1.distill_loss).

Its cache only ever holds accepted positions: after each forward of the backbone the layer
reads the hidden states of the positions that forward kept (the prompt, a plain step's token,
or a tree's accepted nodes), in order. So no compaction is needed: its length always equals the
backbone cache's, and it equals a fresh prefill of the accepted sequence (a test checks it).
The price: one block's forward over the accepted tokens per step (1 to ~5 rows), beside the 30
blocks of the backbone.

Its training over whole answers is draft_layer_rows.py's. It plugs in through this package's
__init__.py, called where the recipe and training start: its heads kind here
(files/heads_files.HEAD_KINDS, register), its training there.

Shapes: a accepted positions, C model dim.
"""
from dataclasses import replace

import torch
import torch.nn as nn

from minimedusa.errors import UserError
from minimedusa.files.heads_files import HEAD_KINDS
from minimedusa.heads import HydraHeads, MedusaConfig, as_features
from minimedusa.kv_cache import KVCache
from minimedusa.model import Block, LlamaConfig, causal_mask, rope_angles, rope_frequencies


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


def register() -> None:
    """Heads files of kind "hydra++" read as these (experiments.register_decoding calls it)."""
    HEAD_KINDS["hydra++"] = HydraPlusPlusHeads


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


class PlusPlusDraft:
    """A draft (draft.py's verbs) for Hydra++ heads: they read the draft layer's output at the
    last accepted position, the layer reading every position the backbone kept into a cache of
    its own; the tree and its tokens are `draft`'s (a TreeDraft or a RankedDraft of them)."""

    def __init__(self, draft):
        self.draft, self.heads, self.cache, self.backbone = draft, draft.heads, None, None

    def start(self, prompt_ids: list[int], cache: KVCache) -> None:
        """A new draft cache as long as the backbone's (`cache`, which it follows). Refused
        where the backbone's cache holds a conversation already: the layer would have to read
        it again (its cache is not kept between runs)."""
        if cache.length:
            raise UserError("Hydra++ heads cannot continue a conversation (their draft layer's "
                            "cache is not kept between turns): use other heads or --baseline")
        self.cache, self.backbone = new_draft_cache(self.heads, cache.capacity), cache

    def read(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer reads the a positions the backbone just kept (hidden (a, C)), after the
        backbone's earlier ones: its cache cut to them first (a timing that rewinds the
        backbone to time another step, assembly/step_latency.py, rewinds the layer with it)."""
        self.cache.rewind(self.backbone.length - hidden.shape[0])
        return read_accepted(self.heads, self.cache, as_features(self.heads, hidden))

    def match(self, root: int) -> int:
        return self.draft.match(root)

    def tree(self, model, n: int, root: int, features: torch.Tensor):
        return self.draft.tree(model, n, root, features)

    def extend(self, tokens: list[int]) -> None:
        self.draft.extend(tokens)


def with_draft_layer(hydra: HydraHeads, model) -> HydraPlusPlusHeads:
    """Trained Hydra heads behind a fresh draft layer: they start as they were (a fresh layer
    passes h_t through), and the layer learns what the context adds."""
    heads = HydraPlusPlusHeads.for_model(model, hydra.config.medusa_num_heads,
                                         hydra.config.medusa_num_layers)
    heads.heads.load_state_dict(hydra.heads.state_dict())
    return heads
