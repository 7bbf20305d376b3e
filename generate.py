"""Generate text with the default model (SmolLM2-135M-Instruct) or any HF Llama folder.

    python generate.py --prompt "What is the capital of France?"
    python generate.py --prompt "Once upon a time" --raw --temperature 0.8 --seed 1
    python generate.py --prompt "Hi" --heads DIR --tree cpu_8 --acceptance typical --json

With Medusa heads (--heads) it decodes with Medusa: one forward of a candidate tree per step;
without them, or with --baseline, plainly: one forward per token. The answer streams to stdout
as tokens are accepted; a summary (tokens, seconds, tokens/s, steps, acceleration rate and the
histogram of tokens per step) follows on stderr.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from minimedusa import acceptance
from minimedusa.default_model import DEFAULT_HEADS_DIR, ensure_default_model
from minimedusa.device import add_device_arguments, pick_device, pick_dtype
from minimedusa.heads import heads_from_spec
from minimedusa.medusa_decoding import StepStats, medusa_decode
from minimedusa.plain_decoding import plain_decode
from minimedusa.sampling import Sampling
from minimedusa.tokenizer import StreamDecoder, Tokenizer
from minimedusa.tree import NAMED_TREES, tree_for_heads
from minimedusa.user_errors import USER_ERRORS
from minimedusa.weights import load_model


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage dump
        self.exit(2, f"error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def parse_args(argv=None):
    p = Parser(description="Generate text with a Llama (default: SmolLM2-135M-Instruct, "
               "fetched and converted into weights/ on first use).")
    p.add_argument("--prompt", required=True, help="the user's message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true",
                   help="feed the prompt as is, without the chat template")
    p.add_argument("--system", default=None,
                   help="system message (default: the model's own default system prompt)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="stop after this many new tokens (default: %(default)s)")
    p.add_argument("--temperature", type=non_negative, default=0.0,
                   help="0 = greedy (default); > 0 samples from softmax(logits / T)")
    p.add_argument("--top-p", type=probability, default=1.0,
                   help="nucleus sampling: keep the smallest token set with this much "
                   "probability (default: %(default)s = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    p.add_argument("--model", type=Path, default=None,
                   help="an HF Llama folder with config.json, *.safetensors and tokenizer.json "
                   "(default: weights/SmolLM2-135M-Instruct, fetched and converted on first use)")
    add_device_arguments(p)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch (default: torch's choice, one per core)")
    p.add_argument("--heads", default=None,
                   help="Medusa heads folder (config.json + medusa_lm_head.safetensors; "
                   "default: the trained heads in weights/ for the default model, none for "
                   "--model); "
                   "'untrained:K' / 'untrained-shared:K' make K heads in the paper's "
                   "initialisation, own / shared projection (they only guess repeats: for "
                   "trying the machinery, not for speed)")
    p.add_argument("--tree", default=None,
                   help=f"candidate tree: {', '.join(NAMED_TREES)}, dense:s1,s2,... (top-s_k "
                   "of head k), or a JSON file of node paths (default: the tree tuned for this "
                   "machine, device and dtype beside the heads (python -m "
                   "minimedusa.tree_search), else one tuned on another machine, else "
                   "mc_sim_7b_63 on CUDA and cpu_8 on the CPU)")
    p.add_argument("--acceptance", choices=["auto", "greedy", "typical", "rejection"],
                   default="auto", help="how candidates are verified (default: auto = greedy "
                   "at temperature 0, lossless rejection sampling above)")
    p.add_argument("--eps", type=non_negative, default=0.09,
                   help="typical acceptance: hard threshold epsilon (default: %(default)s)")
    p.add_argument("--delta", type=non_negative, default=0.3,
                   help="typical acceptance: entropy-scaled threshold delta "
                   "(default: %(default)s)")
    p.add_argument("--baseline", action="store_true",
                   help="plain decoding, one token per forward, even if heads are given")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ids, text, timing) instead of streaming text")
    return p.parse_args(argv)


def load(args):
    """(model, tokenizer, device) as the flags ask."""
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.model if args.model is not None else ensure_default_model()
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    return load_model(folder, device, dtype), Tokenizer.from_folder(folder), device


def prompt_ids(args, tokenizer: Tokenizer) -> list[int]:
    if args.raw:
        ids = tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        ids = tokenizer.encode(tokenizer.chat_prompt(messages))
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def pick_acceptance(args) -> acceptance.Acceptance:
    kind = args.acceptance
    if kind == "auto":
        kind = "greedy" if args.temperature == 0 else "rejection"
    if kind == "greedy":
        if args.temperature != 0:
            raise ValueError("--acceptance greedy decodes at temperature 0: drop --temperature "
                             "or use --acceptance typical or rejection")
        return acceptance.greedy()
    if kind == "typical":
        return acceptance.typical(args.temperature, args.eps, args.delta)
    return acceptance.rejection(args.temperature, args.top_p)


def decoding(args, model, device, ids):
    """(description, iterator of the tokens each step yields) for the mode the flags ask."""
    stops = model.config.stop_ids
    if args.heads is None and args.model is None and DEFAULT_HEADS_DIR.is_dir():
        args.heads = str(DEFAULT_HEADS_DIR)  # the default model comes with trained heads
    if args.baseline or args.heads is None:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
        return "plain", plain_decode(model, ids, args.max_new_tokens, sampling, stops)
    heads = heads_from_spec(args.heads, model)
    tree_name, tree = tree_for_heads(args.tree, heads, model.config, device,
                                     model.embed.weight.dtype, args.heads)
    accept = pick_acceptance(args)
    steps = medusa_decode(model, heads, tree, ids, args.max_new_tokens, accept, stops, args.seed)
    return f"medusa, {tree_name} ({tree.size} tokens), {accept.name}", steps


def run(args) -> dict:
    model, tokenizer, device = load(args)
    ids = prompt_ids(args, tokenizer)
    mode, steps = decoding(args, model, device, ids)
    stream, stats, output = StreamDecoder(tokenizer), StepStats(), []
    start = time.perf_counter()
    for new in steps:
        output += new
        stats.record(len(new))
        if not args.json:
            print(stream.push(new), end="", flush=True)
    seconds = time.perf_counter() - start
    if not args.json:
        print(stream.flush(), end="", flush=True)
    return {"prompt_ids": ids, "output_ids": output,
            "text": tokenizer.decode(output, skip_special=True), "new_tokens": len(output),
            "steps": stats.steps, "acceleration_rate": round(stats.acceleration_rate, 3),
            "accepted_histogram": dict(sorted(stats.histogram.items())),
            "seconds": round(seconds, 4), "tokens_per_s": round(len(output) / seconds, 2),
            "mode": mode, "device": str(device),
            "dtype": str(model.embed.weight.dtype).removeprefix("torch.")}


def main(argv=None):
    args = parse_args(argv)
    try:
        result = run(args)
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("\ninterrupted")
    if args.json:
        print(json.dumps(result))
    else:
        print()
    histogram = " ".join(f"{n}:{c}" for n, c in result["accepted_histogram"].items())
    print(f"[{result['mode']}] {result['new_tokens']} tokens in {result['seconds']:.2f} s: "
          f"{result['tokens_per_s']:.1f} tokens/s, {result['steps']} steps, "
          f"{result['acceleration_rate']:.2f} tokens/step (tokens per step: {histogram}) "
          f"({result['device']}, {result['dtype']})", file=sys.stderr)


if __name__ == "__main__":
    main()
