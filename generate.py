"""Generate text with the default model (SmolLM2-135M-Instruct) or any HF Llama folder.

    python generate.py --prompt "What is the capital of France?"
    python generate.py --prompt "Once upon a time" --raw --temperature 0.8 --seed 1
    python generate.py --prompt "Hi" --heads DIR --tree cpu_8 --acceptance typical --json

With Medusa heads (--heads) it decodes with Medusa: one forward of a candidate tree per step,
the tree's size adapted to this machine as it runs (budget.py); without them, or with
--baseline, plainly: one forward per token. The answer streams to stdout as tokens are
accepted; a summary follows on stderr: tokens, seconds and tokens/s from the prompt to the last
token, steps, acceleration rate, the histogram of tokens per step, the tree sizes used and why,
and the one-time loading time apart.
"""
import json
import sys
import time
from pathlib import Path

from minimedusa.errors import UserError, entry_point, quiet_interrupt

with quiet_interrupt():  # torch loads for seconds: Ctrl-C there ends in one line too
    from minimedusa.decoding import StepStats, medusa_decode, plain_decode
    from minimedusa.files.default_model import DEFAULT_HEADS_DIR, ensure_default_model
    from minimedusa.flags.cli import (Parser, add_compile_argument, add_context_argument,
                                      add_device_arguments, add_draft_vocab_argument,
                                      add_quantize_argument, non_negative, positive_int,
                                      probability)
    from minimedusa.flags.load import (decoding_acceptance, decoding_heads, decoding_model,
                                       decoding_trees, device_and_format, ranked_vocab_size)
    from minimedusa.sampling import Sampling
    from minimedusa.speed.weight_formats import format_of
    from minimedusa.tokenizer import StreamDecoder, Tokenizer
    from minimedusa.tree import NAMED_TREES


def add_prompt_arguments(p) -> None:
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


def add_medusa_arguments(p) -> None:
    p.add_argument("--heads", default=None,
                   help="Medusa heads folder (config.json + medusa_lm_head.safetensors; "
                   "default: the trained heads in weights/ for the default model, none for "
                   "--model); "
                   "'untrained:K' / 'untrained-shared:K' / 'untrained-hydra:K' make K heads in "
                   "the paper's initialisation, own / shared projection / Hydra's (they only "
                   "guess repeats: for trying the machinery, not for speed)")
    add_draft_vocab_argument(p)
    add_context_argument(p)
    p.add_argument("--tree", default=None,
                   help=f"candidate tree: {', '.join(NAMED_TREES)}, dense:s1,s2,... (top-s_k "
                   "of head k), or a JSON file of node paths, used for every step; or ranked:N, "
                   "each step's N nodes of highest path probability under the heads, or ranked, "
                   "N chosen step by step as the default tree's size is (default: "
                   "the tree grown from the heads' calibration, its size chosen step by step "
                   "from step latencies measured on this machine, plain steps included)")
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


def parse_args(argv=None):
    p = Parser(description="Generate text with a Llama (default: SmolLM2-135M-Instruct, "
               "fetched and converted into weights/ on first use).")
    add_prompt_arguments(p)
    add_device_arguments(p)
    add_quantize_argument(p)
    add_compile_argument(p)
    add_medusa_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ids, text, timing) instead of streaming text")
    return p.parse_args(argv)


def load(args):
    """(model, how its step runs, tokenizer) as the flags ask: the weight format, the compiled
    step (speed/plug_in.py, through flags/load.py)."""
    folder = args.model if args.model is not None else ensure_default_model()
    device, weight_format = device_and_format(args, folder)
    model, step = decoding_model(folder, device, weight_format, args.compile)
    return model, step, Tokenizer.from_folder(folder)


def prompt_ids(args, tokenizer: Tokenizer) -> list[int]:
    if args.raw:
        ids = tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        ids = tokenizer.encode(tokenizer.chat_prompt(messages))
    if not ids:
        raise UserError("the prompt is empty")
    return ids


def decoder(args, model):
    """(describe, decode) for the mode the flags ask: decode(prompt ids) iterates over the
    tokens each step yields, describe() names the mode (after the run: which tree sizes the
    budget used). The one-time work, the heads and the tree budget (its step latencies timed
    here at first use), is done here, the flags checked first."""
    stops, n = model.config.stop_ids, args.max_new_tokens
    if args.heads is None and args.model is None and DEFAULT_HEADS_DIR.is_dir():
        args.heads = str(DEFAULT_HEADS_DIR)  # the default model comes with trained heads
    if args.baseline or args.heads is None:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
        return lambda: "plain", lambda ids: plain_decode(model, ids, n, sampling, stops)
    heads = decoding_heads(args.heads, model, args.draft_vocab)
    kind = heads.config.head_kind + (f" heads (draft vocabulary {ranked_vocab_size(heads, model)})"
                                     if heads.vocabulary is not None else " heads")
    accept = decoding_acceptance(args.acceptance, args.temperature, args.top_p, args.eps,
                                 args.delta)
    context = args.context and args.tree in (None, "ranked")  # with the adapted trees only
    trees, budget, tree = decoding_trees(args.tree, heads, model, args.heads, context)
    return (lambda: f"{kind}, {tree()}, {accept.name}",
            lambda ids: medusa_decode(model, heads, trees, budget, ids, n, accept, stops,
                                      args.seed, context=context))


def run(args) -> dict:
    start = time.perf_counter()
    model, step, tokenizer = load(args)
    describe, decode = decoder(args, model)
    loaded, start = time.perf_counter() - start, time.perf_counter()
    ids = prompt_ids(args, tokenizer)  # timed from here: the prompt to the last token
    stream, stats, output = StreamDecoder(tokenizer), StepStats(), []
    for new in decode(ids):
        output += new
        stats.record(len(new))
        if not args.json:
            print(stream.push(new), end="", flush=True)
    seconds = time.perf_counter() - start
    if not args.json:
        print(stream.flush(), end="", flush=True)
    weight = model.embed.weight
    return {"prompt_ids": ids, "output_ids": output,
            "text": tokenizer.decode(output, skip_special=True), "new_tokens": len(output),
            "steps": stats.steps, "acceleration_rate": round(stats.acceleration_rate, 3),
            "accepted_histogram": dict(sorted(stats.histogram.items())),
            "seconds": round(seconds, 4), "tokens_per_s": round(len(output) / seconds, 2),
            "load_seconds": round(loaded, 3), "mode": describe(), "device": str(weight.device),
            "dtype": str(weight.dtype).removeprefix("torch."), "format": format_of(model),
            "step": step}


@entry_point
def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print()
    histogram = " ".join(f"{n}:{c}" for n, c in result["accepted_histogram"].items())
    print(f"[{result['mode']}] {result['new_tokens']} tokens in {result['seconds']:.2f} s: "
          f"{result['tokens_per_s']:.1f} tokens/s, {result['steps']} steps, "
          f"{result['acceleration_rate']:.2f} tokens/step (tokens per step: {histogram}) "
          f"({result['device']}, {result['format']} weights, {result['step']} step; loaded in "
          f"{result['load_seconds']:.1f} s, not counted)", file=sys.stderr)


if __name__ == "__main__":
    main()
