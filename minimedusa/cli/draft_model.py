"""--draft: speculative decoding with a draft model (speculative_decoding.py). The draft: the
same model rounded (--draft int4, w4a8 or int8: its file read again, block by block, into the
format's kernels; on a CPU) or another model folder that shares the target's tokenizer. Each
round's k is chosen by a Budget (budget.py) among DRAFT_SIZES, its priors the two models' step
costs, timed once (cli/step_latency.round_latency), and KEPT_PRIOR; the run then measures
both.
"""
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from minimedusa.budget import Budget
from minimedusa.cli.answer import Decoder
from minimedusa.cli.load import machine_format
from minimedusa.cli.recipe import Recipe, decoding_model
from minimedusa.errors import UserError
from minimedusa.model import Llama
from minimedusa.acceptance import Sampling
from minimedusa.speculative_decoding import MedusaDraft, ModelDraft, speculative_decode
from minimedusa.cli.step_latency import round_latency
from minimedusa.speed.weight_formats import QUANTIZED

DRAFT_SIZES = (0, 1, 2, 3, 4, 6, 8, 12, 16)  # k, the drafts a round; 0: a target's plain step
KEPT_PRIOR = 0.9  # a draft token's chance to be kept, until the run has measured it


def draft_model(spec: str, folder: Path, device: torch.device,
                compile_flag: bool | None) -> tuple[Llama, str]:
    """(the draft, how its step runs in words): the target's folder in the quantized format
    `spec`, or the model folder `spec` in its machine default format; its step compiled as
    --compile asks (None: where that is faster), as the target's."""
    check_draft(spec, folder)
    if spec in QUANTIZED:
        return decoding_model(Recipe(folder, torch.device("cpu"), spec, compile_flag))
    other = Path(spec)
    return decoding_model(Recipe(other, device, machine_format(device, other), compile_flag))


def check_draft(spec: str, folder: Path) -> None:
    """--draft names a quantized format, or a model folder whose tokenizer is the target's
    (in `folder`): else one line, before anything loads."""
    if spec in QUANTIZED:
        return
    draft_folder = Path(spec)
    if not (draft_folder / "config.json").is_file():
        raise UserError(f"--draft {spec}: neither a weight format ({', '.join(QUANTIZED)}) nor a "
                        "model folder (with config.json)")
    if vocabulary(draft_folder) != vocabulary(folder):
        raise UserError(f"--draft {spec}: its tokenizer.json is not the target's ({folder}): a "
                        "draft's tokens must be the target's")


def vocabulary(folder: Path) -> dict[str, int]:
    """A tokenizer's tokens and their ids, added ones included."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"no tokenizer.json in {folder}")
    return HFTokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def draft_budget(target: Llama, draft: Llama) -> Budget:
    """The Budget that chooses each round's k (0: a plain step), from round_seconds' priors and
    KEPT_PRIOR's: a round of k drafts yields 1 + sum_i KEPT_PRIOR^i tokens."""
    latency = round_latency(target, draft, DRAFT_SIZES)
    expected = {k: 1 + sum(KEPT_PRIOR ** i for i in range(1, k + 1)) for k in DRAFT_SIZES if k}
    budget = Budget(DRAFT_SIZES, expected, latency)
    return budget


def speculative_decoder(args, target: Llama, draft: Llama, step: str,
                        proposer: ModelDraft | None = None):
    """generate.py's Decoder for --draft (draft_model's draft, how its step runs, and where it
    decodes with heads its MedusaDraft; else it drafts plainly): the rounds' budget timed, the
    summary's words (the rounds' k, the drafts kept)."""
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    proposer = proposer or ModelDraft(draft, sampling)
    budget = draft_budget(target, draft)
    n, stops = args.max_new_tokens, target.config.stop_ids

    def describe() -> str:
        rounds = " ".join(f"{k}:{c}" for k, c in sorted(budget.used.items()) if c)
        kept = f"{proposer.kept}/{proposer.proposed}" if proposer.proposed else "none"
        heads = (f" with its heads ({proposer.budget.summary()})"
                 if isinstance(proposer, MedusaDraft) else "")
        return (f"speculative decoding, drafts by the {args.draft} model{heads} ({step} step; "
                f"rounds by drafts: {rounds}; drafts kept: {kept}), "
                f"{'greedy' if sampling.greedy else 'sampled'}")
    return Decoder(lambda ids, cache=None: speculative_decode(target, proposer, budget,
                                                              sampling, ids, n, stops),
                   describe, max(budget.sizes) + 1)
