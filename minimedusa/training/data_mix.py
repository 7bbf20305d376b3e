"""One training folder mixed from several self-distillation folders: links to their shards.

Heads are to learn every kind of answer at once (templated and model-written prompts, greedy and
sampled answers), and the data curve wants any first K shards of the mix to hold each kind in
proportion: so the parts are interleaved shard by shard (part 1's shard 0, part 2's shard 0, ...,
part 1's shard 1, ...). train.py holds out a folder's last answers, 1 in 20
(medusa1.split_validation); `--held-out` parts go last, after the interleaved ones, so that they
are among them: answers a model card measures heads on, or other samples of the same prompts, are
then never trained on. A part may be a few of a folder's shards (`FOLDER:0-21,32-95`, shard
numbers, both ends included). `--in-order` puts the parts one after another instead (the shipped
heads' folder: the templated answers, then the model-written ones, whose last answers the model
card measures on).

    python -m minimedusa.training.data_mix --out data/card-mix --in-order data/distill \
        data/distill-mw:0-31
    python -m minimedusa.training.data_mix --out data/train-mix data/distill data/distill-t07 \
        data/distill-mw:0-21,32-95 --held-out data/distill-mw:22-31

The mix is links (relative, so the data folder may move whole) and a meta.json naming its parts;
nothing is copied. It is written beside its place and renamed into it.
"""
import json
import os
import re
import shutil
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from safetensors import safe_open

from minimedusa.cli.flags import Parser, positive_int
from minimedusa.errors import UserError, entry_point, unreadable
from minimedusa.training.medusa1 import DataError, held_out_count, read_meta
from minimedusa.training.self_distill import shard_path

RANGES = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


@dataclass
class Part:
    """One FOLDER[:RANGES] of the command line: a self-distillation folder and the shards of it
    the mix takes."""
    folder: Path
    shards: list[Path]  # in the mix's order
    tokenizer: str  # the fingerprint in its meta.json: parts made with different ones do not mix


def shard_numbers(ranges: str, spec: str) -> list[int]:
    """'0-21,32-95' -> [0, 1, ..., 21, 32, ..., 95] (both ends included)."""
    numbers = []
    for piece in ranges.split(","):
        lo, _, hi = piece.partition("-")
        lo, hi = int(lo), int(hi or lo)
        if hi < lo:
            raise UserError(f"{spec}: the range {piece} runs backwards")
        numbers += range(lo, hi + 1)
    return numbers


def read_part(spec: str) -> Part:
    """FOLDER (every shard) or FOLDER:RANGES (those shards) -> the part, its shards checked."""
    folder, _, ranges = spec.rpartition(":")
    if not folder or not RANGES.fullmatch(ranges):
        folder, ranges = spec, ""
    folder = Path(folder)
    tokenizer = read_meta(folder).get("tokenizer")  # a self-distillation folder, or one line
    if not ranges:
        shards = sorted(folder.glob("shard-*.safetensors"))
        if not shards:
            raise DataError(f"no shards in {folder}")
        return Part(folder, shards, tokenizer)
    shards = [shard_path(folder, i) for i in shard_numbers(ranges, spec)]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise DataError(f"{spec}: {folder} has no {missing[0]} ({len(missing)} of the "
                        f"{len(shards)} shards asked are missing: not made yet?)")
    return Part(folder, shards, tokenizer)


def answers_in(shard: Path) -> int:
    """How many answers a shard holds (its offsets' count, without reading its tensors)."""
    try:
        with safe_open(shard, framework="pt") as st:
            return st.get_slice("answer_offsets").get_shape()[0] - 1
    except Exception as e:  # safetensors reports truncation/corruption with varied types
        raise DataError(unreadable(shard, e)) from None


def mixed_shards(parts: list[Part], held_out: list[Part], first: int | None,
                 in_order: bool = False) -> list[Path]:
    """The parts' shards interleaved shard by shard, or part after part if `in_order` (the
    first `first` of them, if given), then the held-out parts' shards, part after part."""
    if in_order:
        body = [s for p in parts for s in p.shards]
    else:
        rounds = zip_longest(*(p.shards for p in parts))  # each part's next shard, or None
        body = [s for group in rounds for s in group if s is not None]
    if first is not None and first > len(body):
        raise UserError(f"--first {first}: the parts hold {len(body)} shards")
    return body[:first] + [s for p in held_out for s in p.shards]


def no_shard_twice(shards: list[Path]) -> None:
    """A shard in two parts would be trained on twice, or trained on and held out."""
    seen = {}
    for shard in shards:
        real = shard.resolve()
        if real in seen:
            raise UserError(f"{shard} is in the mix twice (also as {seen[real]}): parts must "
                            "not overlap")
        seen[real] = shard


def same_tokenizer(parts: list[Part]) -> str:
    """The parts' tokenizer fingerprint; parts made with different tokenizers do not mix."""
    first = parts[0]
    for p in parts:
        if p.tokenizer != first.tokenizer:
            raise DataError(f"{p.folder} was made with another tokenizer than {first.folder} "
                            f"({p.tokenizer} != {first.tokenizer}): they do not mix")
    return first.tokenizer


def check_held_out(total: int, held: int) -> int:
    """train.py holds out the last held_out_count(total) answers; the held-out parts must be
    among them. Returns how many of the held-out answers come from the interleaved parts' end."""
    n_val = held_out_count(total)
    if held > n_val:
        raise UserError(f"the --held-out parts hold {held} answers, more than the {n_val} "
                        f"(1 in 20 of {total}) train.py holds out: {held - n_val} of them would "
                        f"be trained on; hold out fewer shards or add more data")
    return n_val - held


def write_mix(out: Path, shards: list[Path], meta: dict) -> None:
    """Links to the shards, numbered in order, and meta.json, into `out`: built beside it and
    renamed into place. An earlier mix there is replaced; a folder of data is never touched."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; --out must be a folder")
    if out.exists() and not (out / "meta.json").is_file() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not a data folder; choose another --out")
    if out.exists() and (out / "meta.json").is_file() and "mix" not in read_meta(out):
        raise UserError(f"{out} holds self-distilled data, not a mix; choose another --out")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    home = out.parent.resolve() / out.name  # where the links will sit: their targets from there
    for i, shard in enumerate(shards):
        shard_path(tmp, i).symlink_to(os.path.relpath(shard.resolve(), home))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def mix(out: Path, part_specs: list[str], held_out_specs: list[str] = (),
        first: int | None = None, in_order: bool = False, say=print) -> None:
    parts, held_out = [read_part(s) for s in part_specs], [read_part(s) for s in held_out_specs]
    fingerprint = same_tokenizer(parts + held_out)
    no_shard_twice([s for p in parts + held_out for s in p.shards])
    shards = mixed_shards(parts, held_out, first, in_order)
    counts = [answers_in(s) for s in shards]
    n_held = sum(len(p.shards) for p in held_out)  # the last n_held shards
    total, held = sum(counts), sum(counts[len(shards) - n_held:])
    from_body = check_held_out(total, held)
    meta = {"tokenizer": fingerprint,
            "mix": {"parts": list(part_specs), "held_out": list(held_out_specs), "first": first,
                    "in_order": in_order}}
    write_mix(out, shards, meta)
    held_line = f": the --held-out parts' {held} and {from_body} before them" if held_out else ""
    say(f"{out}: {len(shards)} shards, {total} answers; train.py holds out the last "
        f"{held + from_body}{held_line}")


@entry_point
def main(argv=None) -> None:
    p = Parser(description="Mix self-distillation folders into one training folder (links): "
               "their shards interleaved, then the --held-out parts last, which train.py's "
               "held-out 1 in 20 answers must cover.")
    p.prog = "python -m minimedusa.training.data_mix"  # as typed (else argparse names the file)
    p.add_argument("parts", nargs="+", metavar="FOLDER[:RANGES]",
                   help="a self-distillation folder, or some of its shards: FOLDER:0-21,32-95 "
                   "(shard numbers, both ends included)")
    p.add_argument("--out", type=Path, required=True, help="the mix's folder (replaced if it "
                   "is an earlier mix; never a folder of data)")
    p.add_argument("--held-out", nargs="+", default=[], metavar="FOLDER[:RANGES]",
                   help="parts put last, never trained on (the answers heads are measured on)")
    p.add_argument("--first", type=positive_int, default=None, metavar="K",
                   help="only the first K interleaved shards (the data curve's smaller sizes)")
    p.add_argument("--in-order", action="store_true", help="the parts one after another, not "
                   "interleaved (the last part's last answers are then the held-out ones)")
    args = p.parse_args(argv)
    mix(args.out, args.parts, args.held_out, args.first, args.in_order)


if __name__ == "__main__":
    main()
