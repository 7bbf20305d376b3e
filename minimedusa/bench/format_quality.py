"""How much a weight format changes the model: next-token agreement with float32, and the KL.

    python -m minimedusa.bench.format_quality --out weights/format-quality.json

Held-out chats: the last --prompts seed prompts (the shipped heads trained on the first 6,144;
never MT-Bench, the evaluation) answered greedily by the float32 model. Every format then reads
the same prompt + answer in one forward, and at every answer position we compare it with float32:
top-1 agreement (the same next token), the mean KL(p_float32 || p_format) and the most any
token gained on float32's top one (the largest shift: a format's `error`, its reference check's
bound in weight_formats.py, is 1.5x the largest over its steps, which --steps scores too: fused,
compiled). A format whose top-1 agreement is under 98% is never a default
(speed/defaults.default_format).
So does llama.cpp, where llama-cpp-python is installed and the model is the default one: its
logits of the same tokens, from the GGUF the model came from (Q4_1 weights, and 8-bit
activations in its products: Q8_1), as the yardstick its users already accept.
Shapes: T sequence length, V vocab.
"""
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from minimedusa.cli.flags import Parser, format_list, positive_int
from minimedusa.assembly.recipe import Recipe, decoding_model
from minimedusa.files.default_model import (DEFAULT_MODEL_DIR, ensure_default_gguf,
                                            ensure_default_model)
from minimedusa.errors import entry_point
from minimedusa.files.outputs import check_writable, write_json
from minimedusa.kv_cache import KVCache
from minimedusa.model import causal_mask
from minimedusa.acceptance import Sampling
from minimedusa.training.seed_prompts import seed_prompts
from minimedusa.training.self_distill import answer_batch
from minimedusa.files.tokenizer import Tokenizer
from minimedusa.speed.reference_check import largest_shift
from minimedusa.speed.weight_formats import FLOAT16, FLOAT32, FORMATS, format_named
from minimedusa.files.weights import load_model

MIN_AGREEMENT = 0.98  # below this, a format is not a default
# float32 is the reference; float16 is a GPU format
CPU_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt not in (FLOAT32, FLOAT16))


def held_out_chats(model, tokenizer: Tokenizer, n: int, max_new_tokens: int) -> list[tuple]:
    """(prompt ids, greedy float32 answer ids) for the last n seed prompts."""
    prompts = [tokenizer.encode(tokenizer.chat_prompt([{"role": "user", "content": p["prompt"]}]))
               for p in seed_prompts()[-n:]]
    chats = []
    for i in range(0, n, 16):
        batch = prompts[i:i + 16]
        answers = answer_batch(model, batch, max_new_tokens, Sampling(), model.config.stop_ids,
                               None)
        chats += [(p, a) for p, (a, _) in zip(batch, answers)]
    return chats


def answer_log_probs(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log p(next token) at every answer position: (len(answer), V) float32. In one forward
    into a cache, as a decoding step runs (a fused step runs only so)."""
    tokens = torch.tensor([prompt + answer[:-1]])  # (1, T)
    T = tokens.shape[1]
    cache = KVCache.for_model(model, T)  # note: outside inference mode, as decoding's
    with torch.inference_mode():
        logits, _ = model(tokens, torch.arange(T)[None], causal_mask(0, T), cache,
                          cache.next_slots(T))  # (1, T, V)
    return F.log_softmax(logits[0, len(prompt) - 1:].float(), dim=-1)


def llama_cpp_log_probs(folder: Path, chats: list[tuple]) -> list[torch.Tensor] | None:
    """llama.cpp's log p(next token) at every answer position of each chat, (len(answer), V)
    float32 each; None (saying why) without llama-cpp-python or for another model than the
    default (llama.cpp reads its GGUF)."""
    if importlib.util.find_spec("llama_cpp") is None or (
            Path(folder).resolve() != DEFAULT_MODEL_DIR.resolve()):
        print("llama.cpp left out (needs llama-cpp-python and the default model)",
              file=sys.stderr)
        return None
    from llama_cpp import Llama
    longest = max(len(p) + len(a) for p, a in chats)
    llm = Llama(model_path=str(ensure_default_gguf()), n_ctx=longest, logits_all=True,
                n_threads=torch.get_num_threads(), verbose=False)
    log_probs = []
    for prompt, answer in chats:
        llm.reset()
        llm.eval(prompt + answer[:-1])
        scores = torch.from_numpy(llm.scores[len(prompt) - 1:len(prompt) + len(answer) - 1])
        log_probs.append(F.log_softmax(scores.float(), dim=-1))  # (len(answer), V)
    return log_probs


def compare(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> dict:
    """Top-1 agreement and mean KL(reference || candidate) over every answer position, and the
    most any token gained on the reference's top one (reference_check.largest_shift: what the
    check's bound, a format's `error`), at most and at its 99.9th percentile."""
    ref, cand = torch.cat(reference), torch.cat(candidate)  # (positions, V)
    agree = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
    kl = F.kl_div(cand, ref, log_target=True, reduction="none").sum(-1).mean().item()
    shift = largest_shift(cand, ref)  # (positions,): log-probs shift as their logits do
    return {"top1_agreement": round(agree, 5), "mean_kl": round(kl, 6),
            "max_shift": round(shift.max().item(), 4),
            "shift_p999": round(shift.quantile(0.999).item(), 4),
            "positions": ref.shape[0], "default_ok": agree >= MIN_AGREEMENT}


def step_models(folder: Path, fmt):
    """(words, model) for each step of format `fmt` this machine runs besides the eager one
    (--steps): fused where the blocks fuse, compiled where a compiler works."""
    seen = set()
    for compile_flag in (None, True):
        model, step = decoding_model(Recipe(folder=folder, device=torch.device("cpu"),
                                            weight_format=fmt, compile=compile_flag))
        kind = step.split(" ")[0]  # "fused", "compiled" or "eager"
        if kind not in seen and kind != "eager":
            seen.add(kind)
            yield kind, model


@entry_point
def main(argv=None):
    p = Parser(description="Next-token agreement and KL of each CPU weight "
                                "format against float32, on held-out chats.")
    p.prog = "python -m minimedusa.bench.format_quality"  # as typed (else argparse names the file)
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the default)")
    p.add_argument("--prompts", type=positive_int, default=48, help="held-out chats (default: 48)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help="answer length (default: 128)")
    p.add_argument("--formats", type=format_list(CPU_FORMATS), default=None,
                   help="formats to score, e.g. int4,w4a8 (default: every CPU format: "
                   f"{', '.join(CPU_FORMATS)})")
    p.add_argument("--steps", action="store_true",
                   help="also score each format's fast steps (fused, compiled) where they run: "
                   "their largest shifts set each format's bound (weight_formats.py's error)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.out is not None:
        check_writable(args.out, "--out")  # before minutes of work
    folder = args.model or ensure_default_model()
    tokenizer = Tokenizer.from_folder(folder)
    float32 = load_model(folder)
    chats = held_out_chats(float32, tokenizer, args.prompts, args.max_new_tokens)
    reference = [answer_log_probs(float32, prompt, answer) for prompt, answer in chats]
    results = {}
    for name in args.formats or CPU_FORMATS:
        fmt = format_named(name)
        model, _ = decoding_model(Recipe(folder=folder, device=torch.device("cpu"),
                                         weight_format=fmt, compile=False))  # eager
        results[name] = compare(reference, [answer_log_probs(model, p, a) for p, a in chats])
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
        for kind, fast in step_models(folder, fmt) if args.steps else ():
            results[f"{name} {kind}"] = compare(reference, [answer_log_probs(fast, p, a)
                                                            for p, a in chats])
            print(f"{name} {kind}: {results[name + ' ' + kind]}", file=sys.stderr, flush=True)
    llama_cpp = llama_cpp_log_probs(folder, chats)
    if llama_cpp is not None:
        results["llama.cpp Q4_1"] = compare(reference, llama_cpp)
        print(f"llama.cpp Q4_1: {results['llama.cpp Q4_1']}", file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))
    if args.out:
        write_json(args.out, {"model": folder.name, "chats": len(chats), "formats": results})


if __name__ == "__main__":
    main()
