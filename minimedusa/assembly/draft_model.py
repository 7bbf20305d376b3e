"""--draft: speculative decoding with a draft model (speculative_decoding.py), as the recipe builds
it (assembly/recipe.drafted). The draft: the same model rounded (--draft int4, w4a8 or int8: its file
read again, block by block, into the format's kernels; on a CPU) or another model folder that
shares the target's tokenizer (check_draft). Each step's k, the drafts of its chain, is chosen
by a Budget among DRAFT_SIZES, its priors each chain's step timed with the run's own draft and
rule (assembly/step_latency.py, as the heads' trees are) and KEPT_PRIOR; the run then measures both.
"""
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from minimedusa.errors import UserError
from minimedusa.speed.weight_formats import FORMATS

DRAFT_SIZES = (0, 1, 2, 3, 4, 6, 8, 12, 16)  # k, the drafts a step; 0: a target's plain step
KEPT_PRIOR = 0.9  # a draft token's chance to be kept, until the run has measured it


def expected_tokens() -> dict[int, float]:
    """The Budget's prior tokens a step of k drafts yields: 1 + sum_i KEPT_PRIOR^i."""
    return {k: 1 + sum(KEPT_PRIOR ** i for i in range(1, k + 1)) for k in DRAFT_SIZES if k}


def draft_format(spec: str):
    """The weight format --draft names (one that rounds: the target's own file read into it), or
    None: a model folder."""
    fmt = FORMATS.get(spec)
    return fmt if fmt is not None and fmt.rounds else None


def check_draft(spec: str, folder: Path) -> None:
    """--draft names a quantized format, or a model folder whose tokenizer is the target's
    (in `folder`): else one line, before anything loads."""
    if draft_format(spec) is not None:
        return
    draft_folder = Path(spec)
    if not (draft_folder / "config.json").is_file():
        rounding = ", ".join(name for name, fmt in FORMATS.items() if fmt.rounds)
        raise UserError(f"--draft {spec}: neither a weight format ({rounding}) nor a model "
                        "folder (with config.json)")
    if vocabulary(draft_folder) != vocabulary(folder):
        raise UserError(f"--draft {spec}: its tokenizer.json is not the target's ({folder}): a "
                        "draft's tokens must be the target's")


def vocabulary(folder: Path) -> dict[str, int]:
    """A tokenizer's tokens and their ids, added ones included."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"no tokenizer.json in {folder}")
    return HFTokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
