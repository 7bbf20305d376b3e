"""Prompts from elsewhere than --prompt: standard input's whole text (`echo ... | python
generate.py`), or a file of many (--prompts FILE), answered one after another by the model,
heads and tree budget loaded once, each in a fresh cache, so that each answer is what a run
given that prompt alone gives; or with --batch N, N at a time by plain batched decoding
(batch_decoding.py), each answer still the one a run given it alone gives (greedy). The answers
go out as JSON lines, in the file's order.

A file is one prompt a line, or JSON lines whose every object has a "prompt": a user message
(a string), or a conversation to answer (a list of {"role", "content"} messages, as the chat's
/save writes them).
"""
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from minimedusa.batch_decoding import batch_decode
from minimedusa.decoding import PromptTooLongError, StepStats, check_context
from minimedusa.errors import UserError
from minimedusa.files.default_model import ensure_default_model
from minimedusa.files.outputs import KeptLines
from minimedusa.acceptance import Sampling
from minimedusa.speed.defaults import default_batch
from minimedusa.cli.answer import Answer, decode_answer, summary_line
from minimedusa.assembly.load import device_and_format
from minimedusa.files.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")


def prompt_from_stdin(stdin) -> str:
    """Standard input's whole text, the one prompt (its trailing newline dropped, as `echo`
    adds one). Read as bytes and decoded here: UTF-8 or a one-line error, whatever the
    locale's encoding (under a C locale Python would let bytes through as lone surrogates,
    which no tokenizer takes)."""
    data = (stdin.buffer.read() if hasattr(stdin, "buffer")
            else stdin.read().encode("utf-8", "surrogateescape"))
    try:
        text = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise UserError(f"standard input is not UTF-8 text (byte {data[e.start]:#04x} at "
                        f"offset {e.start}): give the prompt as text") from None
    if not text.strip():
        raise UserError("standard input is empty: no prompt to answer (or --prompt TEXT)")
    return text


def read_prompts(path: Path) -> list[tuple[int, str | list]]:
    """[(line number, prompt)] of a --prompts file: each non-empty line's text, or where every
    one is a JSON object with a "prompt", those (strings or message lists)."""
    try:
        lines = [(i, line) for i, line in enumerate(Path(path).read_text().splitlines(), 1)
                 if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompts {path}: cannot read it ({e})") from None
    if not lines:
        raise UserError(f"--prompts {path}: the file holds no prompt")
    objects = [json_object(line) for _, line in lines]
    if not all(o is not None and "prompt" in o for o in objects):
        if objects[0] is not None and "prompt" in objects[0]:  # JSON lines gone wrong
            bad = next(i for (i, _), o in zip(lines, objects) if o is None or "prompt" not in o)
            raise UserError(f"--prompts {path} line {bad}: not a JSON object with a \"prompt\" "
                            "(the file's first line is one)")
        return lines
    for (i, _), o in zip(lines, objects):
        check_prompt(o["prompt"], f"--prompts {path} line {i}")
    return [(i, o["prompt"]) for (i, _), o in zip(lines, objects)]


def json_object(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def is_conversation(value) -> bool:
    """Whether `value` is a list of {"role", "content"} messages (a role of ROLES, a string)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        for m in value)


def check_prompt(prompt, where: str) -> None:
    """A prompt is a string (a user's message), or a conversation to answer."""
    if not isinstance(prompt, str) and not is_conversation(prompt):
        raise UserError(f"{where}: \"prompt\" must be a string or a list of messages, each "
                        f"{{\"role\": one of {', '.join(ROLES)}, \"content\": a string}}")


def prompt_ids(prompt, tokenizer: Tokenizer, raw: bool, system: str | None,
               context: int) -> list[int]:
    """A prompt's token ids: a user message (with `system` first, if given) through the model's
    chat template, a list of messages through it as they are, or (raw) a string as it is. One
    whose size alone puts it past the model's `context` is refused first (check_size)."""
    check_size(prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt),
               tokenizer, context)
    if raw:
        if not isinstance(prompt, str):
            raise UserError("--raw feeds text as it is: a conversation needs the chat template")
        ids = tokenizer.encode(prompt)
    else:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if system is not None and isinstance(prompt, str):
            messages.insert(0, {"role": "system", "content": system})
        ids = tokenizer.encode(tokenizer.chat_prompt(messages))
    if not ids:
        raise UserError("the prompt is empty")
    return ids


def check_size(text: str, tokenizer: Tokenizer, context: int) -> None:
    """Refuse, in one line, a prompt whose characters alone bound its tokens past the model's
    context (Tokenizer.fewest_tokens), before any work on it: the chat template's rendering,
    the tokenizer's pass (50 MB took minutes and 7.9 GB)."""
    fewest = tokenizer.fewest_tokens(text)
    if fewest > context:
        raise PromptTooLongError(f"the prompt ({len(text):,} characters) has at least "
                                 f"{fewest:,} tokens, but the model's context is {context} "
                                 "tokens: give a shorter one")


def encoded(args, prompts: list, model, tokenizer: Tokenizer) -> list[list[int]]:
    """Every prompt's ids, each checked against the context first (a bad one ends the run
    before any is decoded)."""
    all_ids = []
    for line, prompt in prompts:
        try:
            all_ids.append(prompt_ids(prompt, tokenizer, args.raw, args.system,
                                      model.config.max_position_embeddings))
            check_context(model, len(all_ids[-1]), args.max_new_tokens)
        except UserError as e:
            raise UserError(f"--prompts {args.prompts} line {line}: {e}") from None
    return all_ids


def answer_prompts(args, prompts: list, model, tokenizer: Tokenizer, decoding,
                   out) -> list[Answer]:
    """Answer every prompt of read_prompts(args.prompts) one after another, writing one JSON
    line each to `out` (prompt, answer, tokens, steps, seconds) and a progress line to stderr."""
    answers = []
    for i, ((_, prompt), ids) in enumerate(zip(prompts, encoded(args, prompts, model,
                                                                tokenizer)), 1):
        steps = decoding.decode(ids, args.max_new_tokens, model.config.stop_ids)
        answer = decode_answer(steps, Answer())
        answers.append(answer)
        write_answer(out, prompt, answer, tokenizer)
        print(f"prompts: {i}/{len(prompts)}, {len(answer.ids)} tokens in "
              f"{answer.seconds:.2f} s ({answer.tokens_per_s:.1f} tokens/s)", file=sys.stderr)
    return answers


def batch_size(args, n_prompts: int) -> int:
    """How many prompts at a time (args.batch set): --batch N, or by default the machine's size
    (speed/defaults.py) where the file holds more than one prompt and no flag asks for Medusa's
    trees (--heads, --tree, --acceptance) or a draft model (--draft), which decode one prompt at
    a time."""
    medusa = [flag for flag, given in (("--heads", args.heads is not None),
                                       ("--tree", args.tree is not None),
                                       ("--acceptance", args.acceptance != "auto"),
                                       ("--draft", args.draft is not None)) if given]
    if args.batch is None:
        device, _ = device_and_format(args, args.model or ensure_default_model())
        args.batch = default_batch(device) if n_prompts > 1 and not medusa else 1
    if args.batch > 1 and medusa and not args.baseline:
        raise UserError(f"--batch {args.batch} decodes plainly, {n_prompts} prompts a few at a "
                        f"time; {' and '.join(medusa)} ask for Medusa's trees, which decode one "
                        "prompt at a time: drop one or the other")
    return args.batch


def answer_prompts_batched(args, prompts: list, model, tokenizer: Tokenizer, sampling: Sampling,
                           out) -> tuple[list[Answer], float]:
    """Answer every prompt plainly, args.batch of them at once (batch_decoding.batch_decode):
    (the answers, the seconds from the first prompt to the last token). The JSON lines go out
    in the file's order, each as soon as its answer and those before it are done; an answer's
    "seconds" is when it was done, counted from the first prompt."""
    all_ids = encoded(args, prompts, model, tokenizer)
    start, done = time.perf_counter(), 0
    answers: list[Answer | None] = [None] * len(prompts)
    for index, ids in batch_decode(model, all_ids, args.max_new_tokens, sampling,
                                   model.config.stop_ids, args.batch):
        answers[index] = Answer(ids, StepStats(len(ids), len(ids), Counter({1: len(ids)})),
                                time.perf_counter() - start)
        while done < len(answers) and answers[done] is not None:
            write_answer(out, prompts[done][1], answers[done], tokenizer)
            done += 1
        print(f"prompts: {sum(a is not None for a in answers)}/{len(prompts)} done, "
              f"{answers[index].seconds:.2f} s", file=sys.stderr)
    return answers, time.perf_counter() - start


def write_answer(out, prompt, answer: Answer, tokenizer: Tokenizer) -> None:
    """A prompt's JSON line: prompt, answer, tokens, steps, seconds."""
    text = tokenizer.decode(answer.ids, skip_special=True)
    print(json.dumps({"prompt": prompt, "answer": text, "tokens": len(answer.ids),
                      "steps": answer.stats.steps, "seconds": round(answer.seconds, 4)}),
          file=out, flush=True)


def batched_summary(answers: list[Answer], seconds: float, batch: int, tail: str) -> str:
    """The summary line of a batched run: every answer's tokens over the run's time."""
    tokens = sum(len(a.ids) for a in answers)
    batch = min(batch, len(answers))  # a file of fewer prompts fills fewer rows
    return summary_line(f"plain, {batch} prompts at a time; {len(answers)} prompts", tokens,
                        seconds, tokens, Counter({1: tokens}), tail)


def prompts_summary(mode: str, answers: list[Answer], tail: str) -> str:
    """The summary line over every prompt of the file: their tokens over their decoding time
    (the prompts to their last tokens; the loading, paid once, apart)."""
    histogram = sum((a.stats.histogram for a in answers), Counter())
    return summary_line(f"{mode}; {len(answers)} prompts", sum(len(a.ids) for a in answers),
                        sum(a.seconds for a in answers), sum(a.stats.steps for a in answers),
                        histogram, tail)


def open_out(path: Path | None, prompts_file: Path, prompts: list) -> KeptLines | None:
    """Where the answers go: None for stdout, or --out FILE, written beside it as they come
    (FILE.partial) and renamed over it at the end (outputs.KeptLines: a run stopped keeps its
    answers there, and the same command resumes after them; FILE stays as it was until the
    end). Never the prompts file itself, which the answers would replace."""
    if path is None:
        return None
    if path.exists() and prompts_file.exists() and os.path.samefile(path, prompts_file):
        raise UserError(f"--out {path} is the --prompts file: the answers would replace the "
                        "questions; give another file")
    return KeptLines(path, "--out", [prompt for _, prompt in prompts])
