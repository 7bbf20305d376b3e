"""Generate text with the default model (SmolLM2-135M-Instruct) or any HF Llama folder.

    python generate.py                                   # a chat (cli/chat.py)
    python generate.py --prompt "What is the capital of France?"
    echo "What is the capital of France?" | python generate.py
    python generate.py --prompts questions.txt --out answers.jsonl   # cli/prompts.py
    python generate.py --prompt "Once upon a time" --raw --temperature 0.8 --seed 1
    python generate.py --prompt "Hi" --heads DIR --tree cpu_8 --acceptance typical --json

With Medusa heads (--heads) it decodes with Medusa: one forward of a candidate tree per step,
the tree's size adapted to this machine as it runs (budget.py); without them, or with
--baseline, plainly: one forward per token. The answer streams to stdout as tokens are
accepted; a summary follows on stderr: tokens, seconds and tokens/s from the prompt to the last
token, steps, acceleration rate, the histogram of tokens per step, the tree sizes used and why,
and the one-time loading time apart. A chat does the same turn by turn, in one KV cache kept for
the conversation; a file of prompts pays the loading once for all of them, and is answered
several prompts at a time by plain batched decoding (--batch, batch_decoding.py).
"""
import contextlib
import dataclasses
import json
import sys
import time

from minimedusa.errors import UserError, entry_point, quiet_interrupt

with quiet_interrupt():  # torch loads for seconds: Ctrl-C there ends in one line too
    from minimedusa.cli.answer import Answer, decode_answer, summary_line
    from minimedusa.cli.chat import chat
    from minimedusa.assembly.heads_reading import read_heads
    from minimedusa.cli.generate_flags import parse_args
    from minimedusa.cli.acceptance_rule import acceptance_kind
    from minimedusa.assembly.load import device_and_format, four_bit_checkpoint
    from minimedusa.cli.prompts import (answer_prompts, answer_prompts_batched, batch_size,
                                        batched_summary, open_out, prompt_from_stdin,
                                        prompt_ids, prompts_summary, read_prompts)
    from minimedusa.cli.show import painted, say_legend
    from minimedusa.cli.trace_page import header_of, page
    from minimedusa.assembly.recipe import (Decoding, Recipe, build, decoding_heads, decoding_model,
                                       draft_model)
    from minimedusa.assembly.draft_model import draft_format
    from minimedusa.assembly.trees import decoding_tree, tree_spec
    from minimedusa.decoding import check_context
    from minimedusa.files.default_model import DEFAULT_HEADS_DIR, ensure_default_model
    from minimedusa.speed.defaults import describe_weights
    from minimedusa.speed.weight_formats import FLOAT32
    from minimedusa.files.tokenizer import StreamDecoder, Tokenizer, largest_id
    from minimedusa.files.outputs import check_writable, write_atomically
    from minimedusa.speed.machine import device_name
    from minimedusa.files.weights import read_config


PROBE = "What is the capital of France?"  # the reference check's prompt, without --prompt


def input_mode(args) -> str:
    """"prompts" (--prompts FILE), "chat" (--chat, or standard input a terminal) or "prompt"
    (--prompt, else standard input's whole text, read here: an empty one ends the run before
    the model loads)."""
    if args.prompts is not None:
        return "prompts"
    if args.prompt is None and not args.chat and not sys.stdin.isatty():
        args.prompt = prompt_from_stdin(sys.stdin)
    if args.prompt is None:
        if args.json or args.raw:
            raise UserError(f"{'--json' if args.json else '--raw'} is for one prompt, not a "
                            "chat: give --prompt TEXT")
        args.chat = True
        return "chat"
    return "prompt"


def load(args):
    """(model, how its step runs, its weights in words, tokenizer, drafter, recipe), as
    gpt-fast's _load_model: the flags' recipe (assembly/recipe.py), the model read as it says, the
    flags that must fit it checked, its speed plugged in and held to the eager step; drafter:
    --draft's draft model, loaded first, or None. The heads, the draft and the acceptance
    follow in decoder()."""
    folder = args.model if args.model is not None else ensure_default_model()
    if not folder.is_dir():
        raise UserError(f"model folder {folder} does not exist")
    tokenizer = Tokenizer.from_folder(folder)
    probe = probe_ids(args, tokenizer, read_config(folder))  # a prompt too big: refused here
    device, fmt = device_and_format(args, folder)  # the machine's: speed/defaults.py
    drafter = None
    if args.draft is not None:
        if args.chat:  # its two caches are a run's, not a conversation's
            raise UserError("--draft decodes a prompt or a file of them, not a chat")
        if args.dtype == "auto":
            fmt = FLOAT32  # the model's own text: its float32 weights verify
    recipe = recipe_of(args, folder, device, fmt)
    if args.draft is not None:
        # first: what its loading holds for a while comes before the target's weights are in,
        # not on top of them (the peak resident memory: weights/HISTORY.md, session 29)
        drafter, _ = draft_model(recipe)
    # checked in seconds, before the speed's warm-up; the fast step's logits held to the eager
    # step's on the prompt's first tokens (eager where they part: speed/reference_check.py)
    model, step = decoding_model(recipe, lambda model: check_flags(args, model, tokenizer),
                                 probe)
    # lossy where it rounds, but for a 4-bit format's reading of a 4-bit file (its grid found)
    rounded = fmt.rounds and not (fmt.four_bit and four_bit_checkpoint(folder))
    return (model, step, describe_weights(model.config, fmt, rounded, device), tokenizer, drafter,
            recipe)


def recipe_of(args, folder, device, fmt) -> Recipe:
    """The flags' recipe: context candidates with the adapted trees only; --draft's chains
    verified by greedy acceptance, or by speculative sampling above temperature 0."""
    heads = heads_spec(args)
    rule = acceptance_kind(args) if heads else "greedy"
    if args.draft is not None and args.temperature > 0:
        rule = "speculative"
    return Recipe(folder=folder, device=device, weight_format=fmt, compile=args.compile,
                  heads=heads, draft_vocab=args.draft_vocab, tree=args.tree,
                  context=args.context and args.tree in (None, "ranked"), acceptance=rule,
                  temperature=args.temperature, top_p=args.top_p, eps=args.eps, delta=args.delta,
                  seed=args.seed, draft_model=args.draft, draft_model_heads=drafting_heads(args))


def probe_ids(args, tokenizer, config) -> list[int]:
    """The tokens the reference check feeds the step: the prompt's (--prompt), else a
    question's, rendered as the run renders its prompts (before the model is read: a prompt
    too big for its context, config's, is refused by its size first)."""
    return prompt_ids(args.prompt if args.prompt is not None else PROBE, tokenizer, args.raw,
                      args.system, config.max_position_embeddings)


def check_flags(args, model, tokenizer) -> None:
    """Raise the one-line error of a flag that does not fit the model as read (acceptance flags
    that contradict each other, heads made for another model, a malformed tree or one deeper
    than the heads, a prompt past its context) before its speed is plugged in: the compiled
    step's warm-up takes seconds to minutes, a mistake should not wait for it. The heads read
    here are dropped; decoder() reads them again, in the model's final format. And a
    tokenizer whose ids pass the model's embedding: another model's files."""
    ids = largest_id(tokenizer.tk) + 1
    if ids > model.config.vocab_size:
        raise UserError(f"the tokenizer's ids run to {ids - 1}, but the model's embedding has "
                        f"{model.config.vocab_size} rows (config.json's vocab_size): "
                        "tokenizer.json and the weights are not one model's")
    spec = heads_spec(args)
    if spec is not None:
        acceptance_kind(args)
        heads = read_heads(spec, model, args.draft_vocab)
        tree = tree_spec(args.tree)  # the recipe's parser: a malformed --tree fails here
        if tree.kind == "fixed":
            decoding_tree(tree.name, heads, model)
    if args.prompts is None and args.prompt is not None:  # one prompt (input_mode)
        ids = prompt_ids(args.prompt, tokenizer, args.raw, args.system,
                         model.config.max_position_embeddings)
        check_context(model, len(ids), args.max_new_tokens)


def heads_spec(args) -> str | None:
    """The heads to decode with: --heads, else the default model's trained heads; None for
    plain decoding (--baseline, or a model without heads)."""
    if args.baseline or args.draft is not None:  # --draft: a draft model, not heads
        return None
    if args.heads is None and args.model is None and DEFAULT_HEADS_DIR.is_dir():
        return str(DEFAULT_HEADS_DIR)  # the default model comes with trained heads
    return args.heads


def decoder(args, model, recipe: Recipe, drafter=None) -> Decoding:
    """What the flags ask to decode with (recipe.Decoding): decode(prompt ids, n, stops, cache)
    iterates over the tokens each step yields, describe() names the mode (after the run: which
    tree sizes the budget used). The one-time work, the heads or the draft model's draft and the
    tree budget (its step latencies timed here at first use), is the recipe's build
    (assembly/recipe.py). drafter: load()'s (--draft)."""
    heads = None if recipe.heads is None else decoding_heads(recipe.heads, model,
                                                              recipe.draft_vocab)
    decoding = build(recipe, model, heads, drafter)  # (a chat with Hydra++ heads: refused by
    # their draft, experiments/draft_layer.py, at the turn that continues a conversation)
    say_legend(decoding, args.show)
    return decoding


def drafting_heads(args) -> str | None:
    """The heads --draft's model drafts with (Medusa inside the draft: several drafts a
    forward of it): --heads, else the default model's trained heads where the model drafts for
    itself rounded; greedy only (sampling needs each draft's law), and not with --baseline."""
    if args.draft is None or args.baseline or args.temperature > 0:
        return None
    own = (args.model is None and draft_format(args.draft) is not None
           and DEFAULT_HEADS_DIR.is_dir())
    return args.heads if args.heads is not None else str(DEFAULT_HEADS_DIR) if own else None


def run(args) -> dict:
    """One prompt (--prompt or standard input), streamed unless --json: the result's numbers."""
    start = time.perf_counter()
    if args.trace is not None:
        check_writable(args.trace, "--trace")  # before the loading, not after the answer
    model, step, weights, tokenizer, drafter, recipe = load(args)
    decode = decoder(args, model, recipe, drafter)
    loaded, start = time.perf_counter() - start, time.perf_counter()
    ids = prompt_ids(args.prompt, tokenizer, args.raw, args.system,  # timed from here
                     model.config.max_position_embeddings)
    steps = decode.decode(ids, args.max_new_tokens, model.config.stop_ids)
    yielded = []  # the steps, for --trace's page
    if args.trace is not None:
        steps = noted(steps, yielded)
    stream = None if args.json else painted(StreamDecoder(tokenizer), args.show)
    answer = decode_answer(steps, Answer(), stream, start=start)
    output, stats, seconds = answer.ids, answer.stats, answer.seconds
    weight = model.embed.weight
    result = {"prompt_ids": ids, "output_ids": output,
            "text": tokenizer.decode(output, skip_special=True), "new_tokens": len(output),
            "steps": stats.steps, "acceleration_rate": round(stats.acceleration_rate, 3),
            "accepted_histogram": dict(sorted(stats.histogram.items())),
            "seconds": round(seconds, 4), "tokens_per_s": round(len(output) / seconds, 2),
            "load_seconds": round(loaded, 3), "mode": decode.describe(),
            "device": str(weight.device), "dtype": str(weight.dtype).removeprefix("torch."),
            "format": recipe.weight_format.name, "weights": weights, "step": step}
    if args.trace is not None:
        header = header_of(result, recipe, decode, device_name(weight.device))
        write_atomically(args.trace, lambda tmp: tmp.write_text(
            page(yielded, tokenizer, header), encoding="utf-8"))
        print(f"minimedusa: wrote {args.trace} ({len(yielded)} steps)", file=sys.stderr)
    return result


def noted(steps, into: list):
    """The steps as they come, each noted into `into` on the way."""
    for new in steps:
        into.append(new)
        yield new


def load_once(args):
    """(model, tokenizer, decoder, where and how it runs in words): for a chat or a file of
    prompts, the model, heads and tree budget loaded once for all their answers."""
    start = time.perf_counter()
    model, step, weights, tokenizer, drafter, recipe = load(args)
    decode = decoder(args, model, recipe, drafter)
    return model, tokenizer, decode, (f"{model.embed.weight.device}, {weights}, {step} step; "
                                      f"loaded once in {time.perf_counter() - start:.1f} s")


def run_chat(args) -> None:
    model, tokenizer, decode, where = load_once(args)
    chat(args, model, tokenizer, decode, where)


def run_prompts(args) -> None:
    prompts = read_prompts(args.prompts)  # a bad file or --out said before the loading
    out = open_out(args.out, args.prompts, prompts)
    with out or contextlib.nullcontext():  # --out: into place at the end, else kept to resume
        todo = prompts[out.kept:] if out is not None else prompts
        if todo:
            answer_all(args, todo, sys.stdout if out is None else out)


def answer_all(args, prompts: list, out) -> None:
    """Answer the prompts into `out`, one at a time or args.batch at a time; the summary."""
    if batch_size(args, len(prompts)) > 1:
        return run_batched(args, prompts, out)
    model, tokenizer, decode, where = load_once(args)
    answers = answer_prompts(args, prompts, model, tokenizer, decode, out)
    print(prompts_summary(decode.describe(), answers, f"({where}, not counted)"),
          file=sys.stderr)


def run_batched(args, prompts: list, out) -> None:
    """--prompts, args.batch at a time: the model loaded, no heads (plain decoding)."""
    start = time.perf_counter()
    model, step, weights, tokenizer, _, recipe = load(args)  # --batch decodes plainly
    where = (f"{model.embed.weight.device}, {weights}, {step} step; loaded in "
             f"{time.perf_counter() - start:.1f} s")
    sampling = build(dataclasses.replace(recipe, heads=None, draft_model=None),
                     model).sampling  # plain decoding's
    answers, seconds = answer_prompts_batched(args, prompts, model, tokenizer, sampling, out)
    print(batched_summary(answers, seconds, args.batch, f"({where}, not counted)"),
          file=sys.stderr)


@entry_point
def main(argv=None):
    args = parse_args(argv)
    mode = input_mode(args)
    if mode == "chat":
        return run_chat(args)
    if mode == "prompts":
        return run_prompts(args)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print()
    print(summary_line(result["mode"], result["new_tokens"], result["seconds"], result["steps"],
                       result["accepted_histogram"],
                       f"({result['device']}, {result['weights']}, {result['step']} step; "
                       f"loaded in {result['load_seconds']:.1f} s, not counted)"), file=sys.stderr)


if __name__ == "__main__":
    main()
