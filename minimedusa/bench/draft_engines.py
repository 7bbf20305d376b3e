"""bench's engines for speculative decoding with a draft model (--draft FORMAT): the model in
float32 verifying the drafts of its own rounding, beside float32's plain decoding, greedy and
(at --temperature) sampled: "[float32] plain", "[float32] drafted by int4" and so on, and
greedy the draft decoding with the first --heads ("... with heads", generate.py's default for
the default model), each held to the reference's text as every engine is, and "same as plain"
against "[float32] plain". Each an engine of the one recipe: a field of it apart.
"""
import sys
from dataclasses import replace
from pathlib import Path

from minimedusa.bench.engines import Engines, engine
from minimedusa.assembly.draft_model import draft_format
from minimedusa.assembly.recipe import Recipe, decoding_model, draft_model
from minimedusa.speed.memory_bandwidth import module_bytes
from minimedusa.speed.weight_formats import FLOAT32


def draft_engines(args, folder: Path, device, engines: Engines) -> None:
    """The float32 target, its plain engines and its engines drafted by --draft, into engines."""
    recipe = Recipe(folder=folder, device=device, weight_format=FLOAT32, compile=args.compile)
    target, step = decoding_model(recipe)
    drafted = replace(recipe, draft_model=args.draft)
    drafter, draft_step = draft_model(drafted)  # read once, for every drafted engine
    print(f"[float32] decoding step: {step}; its {args.draft} draft's: {draft_step}",
          file=sys.stderr)
    temperatures = [0.0] + ([args.temperature] if args.temperature > 0 else [])
    for T in temperatures:
        suffix = f" T={T}" if T else ""
        engines.run[f"[float32] plain{suffix}"] = engine(replace(recipe, temperature=T), target)
        rule = "speculative" if T else "greedy"
        engines.run[f"[float32] drafted by {args.draft}{suffix}"] = engine(
            replace(drafted, temperature=T, acceptance=rule), target, drafter=drafter)
        engines.step_bytes[f"[float32] plain{suffix}"] = module_bytes(target)
    if draft_format(args.draft) is None:  # another model: the heads are the target's
        return
    # greedy: the draft decoding with the first --heads, as generate.py's drafting_heads
    engines.run[f"[float32] drafted by {args.draft} with heads"] = engine(
        replace(drafted, draft_model_heads=args.heads[0]), target, drafter=drafter)
