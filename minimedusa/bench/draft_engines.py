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

from minimedusa.bench.engines import Engines, plain_engine, timed
from minimedusa.cli.draft_heads import decoding_heads
from minimedusa.cli.draft_model import draft_budget, draft_model
from minimedusa.cli.drafts import tree_draft
from minimedusa.cli.load import decoding_model
from minimedusa.cli.trees import decoding_budget
from minimedusa.acceptance import Sampling
from minimedusa.speculative_decoding import MedusaDraft, ModelDraft, speculative_decode
from minimedusa.speed.host_greedy import greedy_for
from minimedusa.speed.memory_bandwidth import weight_bytes
from minimedusa.speed.weight_formats import QUANTIZED


def draft_engines(args, folder: Path, device, engines: Engines) -> None:
    """The float32 target, its plain engines and its engines drafted by --draft, into engines."""
    target, step = decoding_model(folder, device, "float32", args.compile)
    draft, draft_step = draft_model(args.draft, folder, device, args.compile)
    print(f"[float32] decoding step: {step}; its {args.draft} draft's: {draft_step}",
          file=sys.stderr)
    budget = draft_budget(target, draft)
    temperatures = [0.0] + ([args.temperature] if args.temperature > 0 else [])
    for T in temperatures:
        suffix = f" T={T}" if T else ""
        engines.run[f"[float32] plain{suffix}"] = plain_engine(target, T)
        engines.run[f"[float32] drafted by {args.draft}{suffix}"] = drafted_engine(
            target, lambda sampling: ModelDraft(draft, sampling), budget, T)
        engines.step_bytes[f"[float32] plain{suffix}"] = weight_bytes(target)
    if args.draft not in QUANTIZED:  # another model: the heads are the target's
        return
    spec = args.heads[0]
    heads = decoding_heads(spec, draft)  # greedy: the draft decoding with the first --heads
    trees, heads_budget, _ = decoding_budget(heads, draft, spec)
    heads_draft = tree_draft(heads, trees, draft, None, None)
    engines.run[f"[float32] drafted by {args.draft} with heads"] = drafted_engine(
        target, lambda sampling: MedusaDraft(draft, heads_draft, copy.deepcopy(heads_budget),
                                             greedy_for(device)), budget, 0.0)


def drafted_engine(target, proposer, budget, temperature: float):
    """Speculative decoding, each question from the same Budget prior (as each generate.py
    process), seeded by the question; proposer(sampling): the question's draft."""
    def run(ids, n, seed):
        sampling = Sampling(temperature, 1.0, seed)
        return timed(speculative_decode(target, proposer(sampling), copy.deepcopy(budget),
                                        sampling, ids, n, set()))
    return run
