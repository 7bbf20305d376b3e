"""bench's engines for speculative decoding with a draft model (--draft FORMAT): the model in
float32 verifying the drafts of its own rounding, beside float32's plain decoding, greedy and
(at --temperature) sampled: "[float32] plain", "[float32] drafted by int4" and so on, and
greedy the draft decoding with the first --heads ("... with heads", generate.py's default for
the default model), each held to the reference's text as every engine is, and "same as plain"
against "[float32] plain".
"""
import copy
import sys
from pathlib import Path

from dataclasses import replace

from minimedusa.acceptance import Sampling
from minimedusa.bench.engines import Engines, engine, timed
from minimedusa.cli.draft_model import draft_budget, draft_model
from minimedusa.cli.recipe import Recipe, build, decoding_model
from minimedusa.speculative_decoding import MedusaDraft, ModelDraft, speculative_decode
from minimedusa.speed.memory_bandwidth import weight_bytes
from minimedusa.speed.weight_formats import QUANTIZED


def draft_engines(args, folder: Path, device, engines: Engines) -> None:
    """The float32 target, its plain engines and its engines drafted by --draft, into engines."""
    recipe = Recipe(folder, device, "float32", args.compile)
    target, step = decoding_model(recipe)
    draft, draft_step = draft_model(args.draft, folder, device, args.compile)
    print(f"[float32] decoding step: {step}; its {args.draft} draft's: {draft_step}",
          file=sys.stderr)
    budget = draft_budget(target, draft)
    temperatures = [0.0] + ([args.temperature] if args.temperature > 0 else [])
    for T in temperatures:
        suffix = f" T={T}" if T else ""
        engines.run[f"[float32] plain{suffix}"] = engine(replace(recipe, temperature=T), target)
        engines.run[f"[float32] drafted by {args.draft}{suffix}"] = drafted_engine(
            target, lambda sampling: ModelDraft(draft, sampling), budget, T)
        engines.step_bytes[f"[float32] plain{suffix}"] = weight_bytes(target)
    if args.draft not in QUANTIZED:  # another model: the heads are the target's
        return
    # greedy: the draft decoding with the first --heads, as generate.py's drafting_heads
    heads = build(Recipe(folder, draft.embed.weight.device, args.draft, heads=args.heads[0]),
                  draft)
    engines.run[f"[float32] drafted by {args.draft} with heads"] = drafted_engine(
        target, lambda sampling: MedusaDraft(draft, heads.draft, copy.deepcopy(heads.budget),
                                             heads.rule), budget, 0.0)


def drafted_engine(target, proposer, budget, temperature: float):
    """Speculative decoding, each question from the same Budget prior (as each generate.py
    process), seeded by the question; proposer(sampling): the question's draft."""
    def run(ids, n, seed):
        sampling = Sampling(temperature, 1.0, seed)
        return timed(speculative_decode(target, proposer(sampling), copy.deepcopy(budget),
                                        sampling, ids, n, set()))
    return run
