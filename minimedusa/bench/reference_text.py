"""bench's "same as the reference" column: each greedy engine's answers against the reference's
text, the eager model of the reading path (float32 on a CPU, bfloat16 on CUDA), by the margin
rule (speed/reference_check.py): an answer may part from the reference's only where the
reference's top two tokens were closer than the engine's format's bound.

Why beside "same as plain": that column compares Medusa with plain decoding on the same step,
so a broken step passes it (both write the same wrong text); this one compares every engine
with a model no speed touched, and a run whose engine fails it says so at its top.
"""
import sys
from pathlib import Path

import torch

from minimedusa.bench.llama_cpp_tools import BINDING, COMPLETION
from minimedusa.decoding import decode_step, new_cache, prefill
from minimedusa.files.weights import load_model
from minimedusa.speed.reference_check import SAME_FORMAT, margins, parting
from minimedusa.speed.weight_formats import format_named

OUTSIDE = (COMPLETION, BINDING)  # other programs' engines, on other weights: not checked


def reference_dtype(device: torch.device) -> torch.dtype:
    """The reference's dtype: float32 on a CPU, bfloat16 on CUDA (the GPU's own format)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@torch.inference_mode()
def greedy_with_margins(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens (stop ids ignored, as bench's engines) and the top-2 margin each was
    picked at."""
    device = model.embed.weight.device
    cache = new_cache(model, len(prompt), n)
    logits, _ = prefill(model, cache, torch.tensor([prompt], device=device))  # (1, V)
    tokens, gaps = [], []
    for _ in range(n):
        tokens.append(logits[0].argmax().item())
        gaps.append(margins(logits).item())
        logits, _ = decode_step(model, cache, torch.tensor([[tokens[-1]]], device=device))
    return tokens, gaps


def reference_answers(folder: Path, device, prompts: list[list[int]], n: int) -> list[tuple]:
    """(tokens, margins) of the reference's greedy answer to each prompt: the model as read,
    eager, nothing plugged in."""
    model = load_model(folder, device, reference_dtype(device))
    answers = []
    for i, prompt in enumerate(prompts):
        answers.append(greedy_with_margins(model, prompt, n))
        print(f"the reference's text (eager {str(model.embed.weight.dtype)[6:]}): "
              f"{i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    return answers


def engine_format(name: str, main_format, transformers_format):
    """The weight format whose bound an engine's answers are held to: "[int8] plain" int8's,
    transformers its dtype's, this project's other engines the run's format; None for the
    sampling engines (their text is drawn) and other programs' (llama.cpp rounds otherwise)."""
    if "T=" in name or name in OUTSIDE:
        return None
    if name.startswith("["):
        return format_named(name[1:name.index("]")])  # the name engines.format_engines gave
    return transformers_format if name == "transformers" else main_format


def same_as_reference_of(references: list[tuple], main_format, transformers_format, device):
    """same_as_reference(engine's name, question index, its answer): whether the answer is the
    reference's text by the margin rule, at the engine's format's bound (on CUDA twice that:
    the reference, eager bfloat16, carries a format's error too); None where not checked
    (engine_format)."""
    scale = SAME_FORMAT if reference_dtype(device) != torch.float32 else 1.0

    def same_as_reference(name: str, i: int, answer: list[int]) -> bool | None:
        fmt = engine_format(name, main_format, transformers_format)
        if fmt is None:
            return None
        tokens, gaps = references[i]
        return parting(answer, tokens, gaps, scale * fmt.error) is None
    return same_as_reference


def verdict(totals: dict, device) -> str:
    """The report's first line: every checked engine wrote the reference's text, or which did
    not (their figures measure a broken step)."""
    reference = f"eager {str(reference_dtype(device)).removeprefix('torch.')}"
    checked = {n: t for n, t in totals.items() if t.get("same_as_reference") is not None}
    failed = [f"{n} ({t['same_as_reference']}/{t['questions']})" for n, t in checked.items()
              if t["same_as_reference"] < t["questions"]]
    if failed:
        return ("REFERENCE CHECK FAILED: " + ", ".join(failed) + f" parted from the {reference}"
                " text where it was sure: those figures measure a broken step")
    return (f"reference check: all {len(checked)} greedy engines wrote the {reference} text "
            "(parting only where its top two tokens were within the format's bound)")
