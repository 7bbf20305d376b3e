"""The reference check: a fast step (fused, compiled, in CUDA graphs) must write the text of
the eager step it replaces, and every format the text of the eager float32 model, on the real
model, where the text is decided.

Why a bound and not equality: a weight format moves every logit a little (bfloat16's rounding,
int4's grid, w4a8's 8-bit rows), and a fast step adds roundings of its own. Where the
reference's top two tokens are closer than that, either may come first and both texts are the
model's: SmolLM2 answers "What is the capital of France?" with "The", 0.082 above "L", and
"L'Étoile, la Marseillaise, la femme, ..." is its own float32 text after that "L". Where the
top two are far apart, a path must pick the reference's token. Two rules say it:
- the margin rule (`parting`): a path's greedy tokens may part from the reference's only at a
  position whose reference top-2 margin is under the format's bound;
- the logits rule (`largest_shift`): at no position does any token gain more than the bound on
  the reference's top token (what would make it win). A path whose logits keep the rule keeps
  the margin rule too.
A broken step (keys written at a wrong slot, a mask that hides a token's own key, a block
skipped) moves logits by whole units and parts from the reference where its margin is wide
(tests/test_reference_paths.py, its negative controls).

generate.py asks `checked_step` once of a fast step, on the first tokens of its prompt, and
decodes eagerly where the step fails. Shapes: T positions, V vocab.
"""
import sys

import torch

from minimedusa.kv_cache import KVCache
from minimedusa.model import Llama, at_least_float32, causal_mask
from minimedusa.speed.plug_in import eager_step, unplug_step
from minimedusa.speed.weight_formats import weight_format

# A format's bound is its `error` (weight_formats.py: the most its steps moved a logit, as
# measured, times 1.5). Two paths of one format each carry the format's error: a CUDA step held
# to the eager bfloat16 reference, and generate.py's check of its fast step (checked_step), a
# net for gross faults
SAME_FORMAT = 2.0

def margins(reference: torch.Tensor) -> torch.Tensor:
    """The reference's top-1 minus top-2 logit at each position: (T, V) -> (T,)."""
    top2 = reference.float().topk(2, dim=-1).values  # (T, 2)
    return top2[:, 0] - top2[:, 1]


def largest_shift(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """At each position, the most any token gained on the reference's top token, from the
    reference's logits to these: (T, V), (T, V) -> (T,), >= 0. A token that gains more than the
    reference's margin there takes the top place."""
    moved = logits.float() - reference.float()  # (T, V)
    top = reference.float().argmax(dim=-1, keepdim=True)  # (T, 1)
    return (moved - moved.gather(-1, top)).amax(dim=-1)  # (T,): 0 where only the top moved


def parting(tokens: list[int], reference: list[int], reference_margins: list[float],
            bound: float) -> int | None:
    """The margin rule: the position where `tokens` part from the reference's greedy tokens at
    a margin of at least `bound` (a wrong token where the reference was sure), or None where
    they are the same or part first where the reference was nearly tied (after a parting the
    two texts go on from different words: nothing after it is compared)."""
    for i, (token, expected) in enumerate(zip(tokens, reference)):
        if token != expected:
            return i if reference_margins[i] >= bound else None
    return None


def probe_sizes(n: int) -> list[int]:
    """How probe_logits feeds n tokens: a prompt, four one-row steps, then an 8-row step (a
    tree's shape); a short prompt one token at a time."""
    return [n - 12, 1, 1, 1, 1, 8] if n >= 14 else [1] * n


@torch.inference_mode()
def forward_rows(model: Llama, cache: KVCache, chunk: list[int]) -> torch.Tensor:
    """Feed chunk after the cache's tokens, causally: its logits (T, V) in float32."""
    device = model.embed.weight.device
    n, T = cache.length, len(chunk)
    positions = torch.arange(n, n + T, device=device)[None]  # (1, T)
    logits, _ = model(torch.tensor([chunk], device=device), positions,
                      causal_mask(n, T, device), cache, cache.next_slots(T))  # (1, T, V)
    cache.advance(T)
    return at_least_float32(logits[0])


def probe_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    """The logits (T, V) of a prompt's first (at most 24) tokens, fed as decoding feeds a run:
    a prefill, steps of one row, a step of several rows."""
    ids = ids[:24]
    # note: made outside inference mode, as decoding makes its caches (compiled_step.warm_up)
    cache = KVCache.for_model(model, len(ids))
    logits, start = [], 0
    for size in probe_sizes(len(ids)):
        logits.append(forward_rows(model, cache, ids[start:start + size]))
        start += size
    return torch.cat(logits)  # (T, V)


def step_disagreement(model: Llama, ids: list[int]) -> float:
    """The largest shift of the model's step (as plugged in) against its eager step, over the
    first tokens of ids."""
    fast = probe_logits(model, ids)
    with eager_step(model):
        eager = probe_logits(model, ids)
    return largest_shift(fast, eager).max().item()


def checked_step(model: Llama, step: str, ids: list[int]) -> str:
    """The step as plug_in made it (`step`: its words) where it gives the eager step's logits
    on ids' first tokens within SAME_FORMAT times the format's bound; else the eager step for
    the rest of the run, said in one line on stderr. Returns how the step runs, in words."""
    if step.startswith("eager"):
        return step
    fmt = weight_format(model)  # plug_in's
    bound = SAME_FORMAT * fmt.error
    shift = step_disagreement(model, ids)
    if shift <= bound:
        return step
    unplug_step(model)
    print(f"minimedusa: the {step} step moved the prompt's logits by {shift:.2f} from the "
          f"eager step's, more than {fmt.name}'s {bound:.2f}: decoding eagerly (slower; "
          "--no-compile says the same; please report this with your machine's lscpu)",
          file=sys.stderr)
    return "eager (the fast step failed the reference check)"
