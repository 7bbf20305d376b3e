"""A Llama, written from scratch: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

This is the backbone Medusa accelerates. Two things make it ready for tree decoding: position ids
are explicit (tree tokens at the same depth share a position, paper section 2), and the attention
mask is an argument of forward (the tree mask is passed exactly like the causal one). forward
returns the logits AND the last hidden state (after the final norm), which the Medusa heads read.
Runs Llama 2/3.x (RoPE scaling "linear" and "llama3", an explicit head dim D != C / H), Qwen2/2.5
(q, k, v biases) and Mistral within its sliding window (files/hf_config.py caps the context at the
window, where a Mistral computes exactly a Llama). Left out, and refused by files/hf_config.py:
other RoPE scalings (yarn, dynamic, longrope), partial rotary dims, MLP or output biases, other
activations, attention beyond a sliding window.

Shapes: B batch, T new tokens, S attended cache slots, C model dim, H query heads,
G key/value heads (grouped-query attention), D head dim, I SwiGLU inner dim, V vocab, L layers.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int  # C
    intermediate_size: int  # the SwiGLU inner dim
    num_hidden_layers: int  # L
    num_attention_heads: int  # H
    num_key_value_heads: int  # G; H % G == 0
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    head_dim: int = 0  # D; 0 means hidden_size // num_attention_heads
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    qkv_bias: bool = False  # Qwen2: biases on the q, k, v projections (never on the output one)
    # None, or how the rotation speeds are rescaled for a longer context than trained on, in HF's
    # keys: {"rope_type": "linear", "factor"} or {"rope_type": "llama3", "factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict | None = None

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def stop_ids(self) -> set[int]:
        """The token ids that end generation: eos_token_id, which HF lets be one id or a list."""
        eos = self.eos_token_id
        return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A few-thousand-parameter Llama for tests: every code path, none of the cost."""
        base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    eos_token_id=1)
        return cls(**{**base, **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., C) -> (..., C), in the weight's dtype
        # note: normalised in float32 even for bf16 activations (style rule 12), then cast to the
        # weight's dtype before the weight, as the reference Llama casts to the activations':
        # the same when both are bf16, and a float32 residual stream (Llama.hidden_states) then
        # feeds the next products in the dtype of their weights
        normed = F.rms_norm(at_least_float32(x), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(self.weight.dtype)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """float32 for bf16/fp16/fp32 activations, float64 stays float64 (the exactness tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rope_frequencies(cfg: LlamaConfig, device) -> torch.Tensor:
    """The rotation speed of each pair of dims, radians per position: (D/2,) float32.

    theta^(-2i/D), the original RoPE, unless the config rescales it to stretch the context.
    """
    D = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, device=device,
                                                     dtype=torch.float32) / D)  # (D/2,)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]  # position p turns as p / factor did in training
    if scaling["rope_type"] == "llama3":
        return llama3_frequencies(inv_freq, scaling["factor"], scaling["low_freq_factor"],
                                  scaling["high_freq_factor"],
                                  scaling["original_max_position_embeddings"])
    raise ValueError(f"unknown rope_type {scaling['rope_type']!r}")


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                       high_freq_factor: float, trained_context: int) -> torch.Tensor:
    """Llama 3.1's rescale of the speeds (D/2,) -> (D/2,), by each pair's wavelength.

    Fast pairs (more than high_freq_factor turns within the trained context) already saw every
    angle in training: kept. Slow pairs (fewer than low_freq_factor turns) would meet angles
    never seen: slowed by `factor`, as linear scaling does. In between: a linear blend of both.
    """
    turns = trained_context * inv_freq / (2 * math.pi)  # (D/2,) turns over the trained context
    # s: 1 keeps the speed, 0 divides it by factor (an exact 0 or 1 outside the blend band)
    s = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    return (1 - s) * inv_freq / factor + s * inv_freq


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor):
    """cos and sin of each position's rotation angles: (B, 1, T, D) each, float32.

    positions: (B, T); inv_freq: (D/2,) from rope_frequencies. Computed per forward from the
    explicit positions (a few tiny ops) rather than kept in a buffer, so that casting the model
    to bf16 can never round the angles of far positions.
    """
    angles = positions.unsqueeze(-1).float() * inv_freq  # (B, T, D/2)
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # (B, 1, T, D): both halves
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + D/2]) by its angle (HF Llama's "rotate_half" layout).

    x: (B, heads, T, D); cos, sin: (B, 1, T, D).
    """
    xf = at_least_float32(x)
    x1, x2 = xf.chunk(2, dim=-1)  # (B, heads, T, D/2) each
    rotated_half = torch.cat([-x2, x1], dim=-1)  # (B, heads, T, D)
    return (xf * cos + rotated_half * sin).to(x.dtype)


# a forward of at most this many new tokens in all (a plain step, a Medusa tree, a short prompt,
# a batch's step of a token a row) attends with exact_attention; training's batches or a long
# prompt with SDPA's fused kernel, which never holds the (T, S) scores
EXACT_ATTENTION_TOKENS = 256


def attention(q, k, v, mask, exact: nn.Module):
    """Each query's softmax over the keys it may see, times the values: (B, H, T, D).

    q: (B, H, T, D); k, v: (B, G, S, D); mask: (B, 1, T, S) bool, True = may attend.
    exact: ExactAttention below, or a module that computes what it computes (the compiled
    step's C kernel, speed/attention_kernel.py, swapped in after loading).
    """
    if q.shape[0] * q.shape[2] <= EXACT_ATTENTION_TOKENS:
        return exact(q, k, v, mask)
    # enable_gqa: each group of H // G query heads reads one key/value head, no repeat copy
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def exact_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(D), masked) v, its sums in float64: (B, H, T, D) in q's dtype.

    Why float64: its sums come out the same whatever order their terms are added in (a product
    of two bf16 or fp32 numbers is exact in float64, and 53 bits leave the rounding of a sum far
    below what the final cast keeps), so a token's output depends only on the keys it sees, not
    on which slots they sit in nor on how many other rows are computed beside it.
    subtle: Medusa's greedy output equals plain greedy's only if a tree node's row equals the
    plain step's row for the same token to the bit: the node sees its ancestors at slots n + node
    index, the plain step the same keys at n, n + 1, ..., so float32 sums add them in another
    order and round differently, and bfloat16 logits tie often enough for that to flip a token
    (measured: 3 of 8 MT-Bench answers identical over 256 tokens with float32 sums, 8 of 8 here).
    """
    B, H, T, D = q.shape
    G, S = k.shape[1], k.shape[2]
    R = H // G  # query heads per key/value head: query head g * R + r reads key/value head g
    q64 = q.reshape(B, G, R * T, D).double()  # (B, G, R*T, D): a group's queries, stacked
    scores = q64 @ k.double().transpose(-1, -2) / math.sqrt(D)  # (B, G, R*T, S)
    scores = scores.view(B, G, R, T, S).masked_fill(~mask.unsqueeze(1), float("-inf"))
    weights = scores.softmax(dim=-1).view(B, G, R * T, S)  # (B, G, R*T, S)
    return (weights @ v.double()).view(B, H, T, D).to(q.dtype)  # (B, H, T, D)


class ExactAttention(nn.Module):
    """exact_attention as a module: what a decoding step's attention is, and what a faster twin
    (speed/attention_kernel.py) replaces."""

    def forward(self, q, k, v, mask):
        return exact_attention(q, k, v, mask)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        # note: D is the config's head_dim, which need not be C / H (Mistral NeMo: C 5120, H 32,
        # D 128): q is H * D wide and wo reads H * D, never C
        # q, k and v in one product, as gpt-fast does (files/weights.py concatenates HF's q_proj,
        # k_proj, v_proj into it): decoding on a CPU pays per product it calls, not only per
        # weight it reads (one product of 960 outputs costs less than three of 576, 192, 192)
        self.wqkv = nn.Linear(cfg.hidden_size, (self.n_head + 2 * self.n_kv_head) * self.head_dim,
                              bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)
        # the decoding steps' attention: the float64 reference, or a twin swapped in after
        # loading (speed/attention_kernel.py)
        self.exact = ExactAttention()

    def forward(self, x, cos, sin, mask, cache, slots):
        """x: (B, T, C); mask: (B, 1, T, S) bool, True = may attend.

        Without a cache the T tokens attend to each other (S == T). With one (this layer's
        kv_cache.LayerCache), their keys/values are stored at its slots `slots` (T,) and the
        tokens attend to slots [0, S).
        """
        B, T, _ = x.shape
        H, G, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.wqkv(x).split([H * D, G * D, G * D], dim=-1)  # (B, T, H*D), 2x (B, T, G*D)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, G, D).transpose(1, 2)  # (B, G, T, D)
        v = v.view(B, T, G, D).transpose(1, 2)  # (B, G, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(slots, k, v, n_read=mask.shape[-1])  # (B, G, S, D)
        y = attention(q, k, v, mask, self.exact)  # (B, H, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one product (as wqkv above)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, T, I) each
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, slots):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, slots)
        return x + self.mlp(self.mlp_norm(x))


class Blocks(nn.ModuleList):
    """The blocks, one after another, each with its layer of the cache. A module of its own so
    that a faster way to run them all can take its place after loading (speed/fused_block.py)."""

    def forward(self, x, cos, sin, mask, cache=None, slots=None):  # (B, T, C) -> (B, T, C)
        layer_caches = cache.layers if cache is not None else [None] * len(self)
        for layer, layer_cache in zip(self, layer_caches):
            x = layer(x, cos, sin, mask, layer_cache, slots)
        return x


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = Blocks([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def hidden_states(self, tokens, positions, mask, cache=None, slots=None):
        """The last hidden state after the final norm: (B, T, C).

        tokens, positions: (B, T) int64. Position ids are explicit because in a Medusa tree the
        siblings share one (prefix length + depth) although they sit in different cache slots.
        mask: (B, T, S) bool, True where token t may attend to slot s (or to token s, no cache).
        cache, slots: a KVCache and the (T,) slots where these tokens' keys/values are written.
        """
        cos, sin = rope_angles(positions, rope_frequencies(self.config, positions.device))
        mask = mask.unsqueeze(1)  # (B, 1, T, S): the same mask for every head
        # the residual stream in float32 even for bf16 weights (as llama.cpp keeps its
        # activations): 60 additions rounded to bf16's 8 bits are much of what a bf16 model
        # loses against float32 (format_quality.py: mean KL 0.00098 -> 0.00062, top-1
        # agreement 98.2% -> 98.5%, for a few element-wise operations a block)
        x = at_least_float32(self.embed(tokens))  # (B, T, C)
        return self.norm(self.layers(x, cos, sin, mask, cache, slots))

    def forward(self, tokens, positions, mask, cache=None, slots=None):
        """(logits (B, T, V), hidden (B, T, C)): the backbone's next-token scores and what the
        Medusa heads read."""
        hidden = self.hidden_states(tokens, positions, mask, cache, slots)
        return self.lm_head(hidden), hidden


def causal_mask(prefix_len: int, n_new: int, device=None) -> torch.Tensor:
    """(1, T, prefix + T) bool: new token t sees the whole cached prefix and new tokens <= t."""
    rows = torch.arange(n_new, device=device).unsqueeze(1)  # (T, 1)
    cols = torch.arange(prefix_len + n_new, device=device).unsqueeze(0)  # (1, S)
    return (cols <= rows + prefix_len).unsqueeze(0)
