"""Generate text with the default model (SmolLM2-135M-Instruct) or any HF Llama folder.

    python generate.py --prompt "What is the capital of France?"
    python generate.py --prompt "Once upon a time" --raw --temperature 0.8 --seed 1
    python generate.py --prompt "Hi" --json

The answer streams to stdout as it is produced; a one-line summary (tokens, seconds, tokens/s)
follows on stderr. Plain decoding (one token per forward) is the only mode until Medusa heads
exist; --baseline names it explicitly.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from minimedusa.default_model import DefaultModelError, ensure_default_model
from minimedusa.device import pick_device, pick_dtype
from minimedusa.kv_cache import CacheOverflowError
from minimedusa.model import ConfigError
from minimedusa.plain_decoding import PromptTooLongError, plain_decode
from minimedusa.sampling import Sampling
from minimedusa.tokenizer import StreamDecoder, Tokenizer
from minimedusa.weights import WeightsError, load_model

# Errors that come from what the user asked for (bad flag value, file, prompt): one line each.
USER_ERRORS = (ConfigError, WeightsError, PromptTooLongError, CacheOverflowError,
               DefaultModelError, FileNotFoundError, ValueError)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage dump
        self.exit(2, f"error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
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
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples from softmax(logits / T)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest token set with this much "
                   "probability (default: %(default)s = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    p.add_argument("--model", type=Path, default=None,
                   help="an HF Llama folder with config.json, *.safetensors and tokenizer.json "
                   "(default: weights/SmolLM2-135M-Instruct, fetched and converted on first use)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="auto (default: float32 on CPU, bfloat16 on CUDA), float32, bfloat16, "
                   "float16")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch (default: torch's choice, one per core)")
    p.add_argument("--baseline", action="store_true",
                   help="plain decoding, one token per forward (the only mode until Medusa "
                   "heads exist)")
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


def stop_ids(model) -> set[int]:
    eos = model.config.eos_token_id
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())


def run(args) -> dict:
    model, tokenizer, device = load(args)
    ids = prompt_ids(args, tokenizer)
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    stream = StreamDecoder(tokenizer)
    output, steps = [], 0
    start = time.perf_counter()
    for new in plain_decode(model, ids, args.max_new_tokens, sampling, stop_ids(model)):
        output += new
        steps += 1
        if not args.json:
            print(stream.push(new), end="", flush=True)
    seconds = time.perf_counter() - start
    if not args.json:
        print(stream.flush(), end="", flush=True)
    return {"prompt_ids": ids, "output_ids": output,
            "text": tokenizer.decode(output, skip_special=True), "new_tokens": len(output),
            "steps": steps, "seconds": round(seconds, 4),
            "tokens_per_s": round(len(output) / seconds, 2), "mode": "plain",
            "device": str(device), "dtype": str(model.embed.weight.dtype).removeprefix("torch.")}


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
    print(f"[{result['mode']}] {result['new_tokens']} tokens in {result['seconds']:.2f} s: "
          f"{result['tokens_per_s']:.1f} tokens/s, {result['steps']} steps "
          f"({result['device']}, {result['dtype']})", file=sys.stderr)


if __name__ == "__main__":
    main()
