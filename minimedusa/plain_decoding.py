"""Plain autoregressive decoding: prefill the prompt, then one forward per new token.

This is the baseline every Medusa speedup is measured against (paper section 7: acceleration
rate 1.0) and the reference that Medusa's greedy output must equal token for token, so it is
kept as simple as the static KV cache allows. Left out: batching (the training data generator
will need it), beam search.

Shapes: B batch (1 here), T tokens, V vocab, C model dim.
"""
from typing import Iterator

import torch

from minimedusa.kv_cache import KVCache
from minimedusa.model import Llama, causal_mask
from minimedusa.sampling import Sampling, next_token


class PromptTooLongError(ValueError):
    """The prompt plus the requested new tokens exceed the model's context."""


def new_cache(model: Llama, prompt_len: int, max_new_tokens: int, margin: int = 0) -> KVCache:
    """A cache for prompt + new tokens (+ a margin for Medusa's tree tokens), checked against
    the model's context length first so that the error names the real problem."""
    context = model.config.max_position_embeddings
    if prompt_len + max_new_tokens > context:
        raise PromptTooLongError(
            f"the prompt has {prompt_len} tokens and {max_new_tokens} new ones were asked for, "
            f"but the model's context is {context} tokens")
    return KVCache.for_model(model, capacity=prompt_len + max_new_tokens + margin)


@torch.inference_mode()
def prefill(model: Llama, cache: KVCache, prompt: torch.Tensor):
    """Run the prompt (1, T) through the model into an empty cache.

    Returns (logits (1, V), hidden (1, C)) at the prompt's last position only: the LM head
    over every prompt token would be wasted work (49k x 576 per token on the default model).
    """
    T = prompt.shape[1]
    positions = torch.arange(T, device=prompt.device).unsqueeze(0)  # (1, T)
    hidden = model.hidden_states(prompt, positions, causal_mask(0, T, prompt.device),
                                 cache, cache.slots(0, T))  # (1, T, C)
    cache.length = T
    last = hidden[:, -1]  # (1, C)
    return model.lm_head(last), last


@torch.inference_mode()
def decode_step(model: Llama, cache: KVCache, token: torch.Tensor) -> torch.Tensor:
    """Feed one token (1, 1) at the end of the cached sequence; logits (1, V) for the next."""
    n = cache.length
    positions = torch.full((1, 1), n, device=token.device)  # (1, 1)
    logits, _ = model(token, positions, causal_mask(n, 1, token.device), cache,
                      cache.slots(n, 1))  # (1, 1, V)
    cache.length = n + 1
    return logits[:, -1]


def plain_decode(model: Llama, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
                 stop_ids: set[int]) -> Iterator[list[int]]:
    """Yield the new tokens one step at a time ([token] per step) until a stop id (which is
    yielded) or max_new_tokens. The caller times and streams; this only decodes."""
    device = model.embed.weight.device
    cache = new_cache(model, len(prompt_ids), max_new_tokens)
    generator = sampling.generator(device)
    logits, _ = prefill(model, cache, torch.tensor([prompt_ids], device=device))
    for i in range(max_new_tokens):
        token = next_token(logits, sampling, generator)  # (1,)
        token_id = token.item()  # the one host sync per step: needed to stop at EOS
        yield [token_id]
        if token_id in stop_ids or i == max_new_tokens - 1:
            return
        logits = decode_step(model, cache, token.unsqueeze(0))
