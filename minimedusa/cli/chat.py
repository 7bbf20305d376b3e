"""The command line's conversation: `python generate.py` on a terminal, or --chat (then a script
of messages on standard input, one a line).

Each turn renders the whole history with the model's own chat template and decodes the answer
with the loop a single prompt uses (decoding.medusa_decode or plain_decode, as the flags chose),
in one KV cache kept for the whole conversation: a turn prefills only the tokens its rendering
adds to those the cache holds. Where the rendering does not extend them token for token (an
answer whose text encodes into other tokens than the model generated, a template that rewrites
past turns) the cache keeps their longest common prefix (KVCache.rewind) and the rest is
prefilled. Either way each answer is, to the bit, what a fresh run given the whole history
answers (decoding.prefill: a token's row is the same arithmetic wherever it came from).
Past the model's context the oldest exchanges are dropped, or the chat starts over
(--when-full). The commands follow the reference Medusa CLI's (!!exit, !!reset, !!remove,
!!regen, !!save, !!load). Left out: messages over several lines, Hydra++ heads (their draft
layer's cache is not kept between turns).
"""
import contextlib
import importlib
import json
import sys
from pathlib import Path

from minimedusa.errors import UserError
from minimedusa.files.outputs import write_atomically
from minimedusa.cli.answer import Answer, decode_answer, summary_line
from minimedusa.cli.prompts import ROLES, is_conversation
from minimedusa.cli.show import painted
from minimedusa.kv_cache import KVCache
from minimedusa.files.tokenizer import StreamDecoder, Tokenizer

COMMANDS = {
    "/help": "list these commands",
    "/exit": "end the chat (so does Ctrl-D)",
    "/reset": "start over (a system message stays)",
    "/undo": "remove the last exchange: your last message and its answer",
    "/regen": "answer your last message again (the same answer, greedy or with --seed)",
    "/save FILE": 'write the conversation to FILE as JSON: a list of {"role", "content"}',
    "/load FILE": "continue a conversation from FILE (as /save writes it)",
}
HELP = "\n".join(f"  {name:<12}{what}" for name, what in COMMANDS.items()) + (
    "\n  Ctrl-C stops an answer (what came of it stays in the conversation).\n  A message "
    "that starts with / is written //.")


def say(text: str) -> None:
    """The chat's own lines go to stderr: stdout holds the answers alone."""
    print(f"chat: {text}", file=sys.stderr, flush=True)


class Conversation:
    """The messages so far and the KV cache that holds them: `cached` are the token ids whose
    keys and values the cache holds (cache.length of them), kept here because the cache keeps
    no ids (decoding.decoding_cache checks lengths only)."""

    def __init__(self, cache: KVCache, system: str | None):
        self.cache, self.cached = cache, []
        self.messages = [] if system is None else [{"role": "system", "content": system}]
        self.extends = False  # whether the next turn's rendering should extend `cached`

    def keep(self, ids: list[int]) -> int:
        """Keep in the cache the longest common prefix of what it holds and the next prompt
        `ids`, at most all but the prompt's last token (a turn prefills at least one: its
        logits give the answer's first token); returns its length."""
        n, most = 0, min(len(self.cached), len(ids) - 1)
        while n < most and self.cached[n] == ids[n]:
            n += 1
        self.cache.rewind(n)
        del self.cached[n:]
        return n

    def answered(self, messages: list[dict], ids: list[int], answer: list[int], text: str):
        """After a turn, finished or stopped by Ctrl-C: the cache holds the prompt and the
        answer but its last token (no step has fed it yet), or less where the answer stopped
        early (in the prefill: part of the prompt), or more (a Medusa step accepted tokens
        the stop cut off: dropped)."""
        held = min(self.cache.length, len(ids) + len(answer))
        self.cache.rewind(held)
        self.cached = (ids + answer)[:held]
        self.messages = messages + [{"role": "assistant", "content": text}]
        self.extends = True

    def edited(self, messages: list[dict]) -> None:
        """The messages changed by a command: the next turn's rendering may leave the cache."""
        self.messages, self.extends = messages, False

    def last_user(self) -> int | None:
        """The index of the user's last message, if any."""
        return next((i for i in reversed(range(len(self.messages)))
                     if self.messages[i]["role"] == "user"), None)


class Chat:
    """A conversation with the model: its turns and the commands that edit it."""

    def __init__(self, args, model, tokenizer: Tokenizer, decoding):
        self.tokenizer, self.decoding = tokenizer, decoding
        self.max_new_tokens, self.when_full = args.max_new_tokens, args.when_full
        self.show = args.show  # each answer's tokens coloured by what guessed them (show.py)
        self.context = model.config.max_position_embeddings
        if self.max_new_tokens >= self.context:
            raise UserError(f"--max-new-tokens {self.max_new_tokens} leaves no room for a "
                            f"conversation in the model's context of {self.context} tokens")
        # the whole context, plus the tree tokens a Medusa step writes before compaction
        cache = KVCache.for_model(model, capacity=self.context + decoding.margin)
        self.conversation = Conversation(cache, args.system)
        self.warned = False  # the template's rendering left the cache: said once

    def render(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.chat_prompt(messages))

    def fit(self, messages: list[dict]):
        """(messages, their ids) with room for an answer in the model's context: as they are,
        or (said in one line) with the oldest exchanges dropped or the last message alone kept,
        as --when-full asks; None where the last message alone does not fit (by its size alone
        where that tells: Tokenizer.fewest_tokens, before the template renders it)."""
        room = self.context - self.max_new_tokens
        if self.tokenizer.fewest_tokens(messages[-1]["content"]) > room:
            say(f"your message ({len(messages[-1]['content']):,} characters) does not fit the "
                f"model's context of {self.context} tokens; not sent")
            return None
        ids = self.render(messages)
        if len(ids) <= room:
            return messages, ids
        total, system = len(ids), int(messages[0]["role"] == "system")
        if self.when_full == "reset":
            messages = messages[:system] + messages[-1:]
            ids = self.render(messages)
        dropped = 0
        while len(ids) > room and len(messages) > system + 1:
            messages, dropped = drop_oldest(messages, system), dropped + 1
            ids = self.render(messages)
        if len(ids) > room:
            say(f"your message takes {len(ids)} tokens: with {self.max_new_tokens} new ones it "
                f"does not fit the model's context of {self.context} tokens; not sent")
            return None
        full = (f"the conversation ({total} tokens) and {self.max_new_tokens} new ones would "
                f"pass the model's context of {self.context} tokens")
        say(f"{full}: the chat starts over from your message (--when-full reset)"
            if self.when_full == "reset" else
            f"{full}: the oldest {dropped} exchange(s) dropped (--when-full drop-oldest)")
        return messages, ids

    def turn(self, messages: list[dict]) -> None:
        """Answer the last message of `messages` (the history, then the user's message),
        streaming the answer to stdout and a summary line to stderr."""
        fitted = self.fit(messages)
        if fitted is None:
            return
        messages, ids = fitted
        conversation = self.conversation
        held, kept = len(conversation.cached), conversation.keep(ids)
        if (kept < held and conversation.extends and messages[:-1] == conversation.messages
                and not self.warned):
            say(f"the chat template's rendering of the conversation differs from the tokens "
                f"the model generated after token {kept}: the cache keeps the {kept} they share "
                "and the rest is prefilled again (said once)")
            self.warned = True
        answer = Answer()
        try:
            steps = self.decoding.decode(ids, self.max_new_tokens, self.decoding.model.config
                                         .stop_ids, conversation.cache)
            decode_answer(steps, answer, painted(StreamDecoder(self.tokenizer), self.show))
            print(flush=True)
        except KeyboardInterrupt:
            print(flush=True)
            say("stopped: the answer so far stays in the conversation (/undo removes the "
                "exchange, /regen answers again)")
        text = self.tokenizer.decode(answer.ids, skip_special=True)
        conversation.answered(messages, ids, answer.ids, text)
        prefilled = f"(prefilled {len(ids) - kept} new tokens, {kept} kept in the cache)"
        print(summary_line(self.decoding.describe(), len(answer.ids), answer.seconds,
                           answer.stats.steps, answer.stats.histogram, prefilled),
              file=sys.stderr, flush=True)

    def command(self, line: str) -> bool:
        """Run a command line ("/undo", "/save FILE", ...); False where it ends the chat."""
        name, _, argument = line.partition(" ")
        conversation, argument = self.conversation, argument.strip()
        if name == "/exit":
            return False
        if name == "/help":
            print(HELP, file=sys.stderr)
        elif name == "/reset":
            conversation.edited([m for m in conversation.messages[:1] if m["role"] == "system"])
            say("the conversation starts over")
        elif name in ("/undo", "/regen"):
            last = conversation.last_user()
            if last is None:
                say(f"no message of yours to {name[1:]}")
            elif name == "/undo":
                conversation.edited(conversation.messages[:last])
                say("your last message and its answer are removed")
            else:
                self.turn(conversation.messages[:last + 1])
        elif name in ("/save", "/load") and not argument:
            say(f"{name} needs a file name: {name} FILE")
        elif name == "/save":
            save(conversation.messages, Path(argument))
        elif name == "/load":
            messages = load(Path(argument))
            if messages is not None:
                conversation.edited(messages)
        else:
            say(f"unknown command {name} (/help lists them; a message that starts with / is "
                "written //)")
        return True


def drop_oldest(messages: list[dict], system: int) -> list[dict]:
    """The messages without their oldest exchange (after the `system` first ones): the oldest
    message and the answers after it, up to the next user message; the last message stays."""
    end = system + 1
    while end < len(messages) - 1 and messages[end]["role"] != "user":
        end += 1
    return messages[:system] + messages[end:]


def save(messages: list[dict], path: Path) -> None:
    try:
        write_atomically(path, lambda tmp: tmp.write_text(
            json.dumps(messages, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"))
    except OSError as e:
        return say(f"cannot write {path}: {e}")
    say(f"{len(messages)} messages saved to {path}")


def load(path: Path) -> list[dict] | None:
    """The messages in a file /save wrote; None (said in one line) where it holds none."""
    try:
        messages = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return say(f"cannot load {path}: {e}")
    if not is_conversation(messages):
        return say(f"cannot load {path}: not a list of messages, each {{\"role\": one of "
                   f"{', '.join(ROLES)}, \"content\": a string}}")
    say(f"{len(messages)} messages loaded from {path}")
    return messages


def read_lines(interactive: bool):
    """The user's lines, stripped, until Ctrl-D (end of input). On a terminal with a prompt and
    line editing (input(), through readline where Python has it); Ctrl-C there drops the line
    typed so far. A line that is not UTF-8 is said and skipped."""
    if interactive:
        line_editing()
    while True:
        try:
            line = input("> ") if interactive else read_line(sys.stdin)
        except EOFError:
            return
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        except UnicodeDecodeError as e:
            say(f"that line is not UTF-8 text (byte {e.object[e.start]:#04x}): not sent")
            continue
        yield line.strip()


def line_editing() -> None:
    """input() through GNU readline (or libedit): line editing and history, and lines of any
    length. note: without it a terminal's own line discipline cuts a line at 4,095 bytes
    without a word, and a pasted page loses its end."""
    with contextlib.suppress(ImportError):
        importlib.import_module("readline")  # importing it is what switches input() over


def read_line(stdin) -> str:
    """The next line of a script on standard input, decoded as UTF-8 (a UnicodeDecodeError
    where it is not); EOFError at its end."""
    raw = stdin.buffer.readline() if hasattr(stdin, "buffer") else stdin.readline()
    if not raw:
        raise EOFError
    return raw.decode("utf-8") if isinstance(raw, bytes) else raw


def chat(args, model, tokenizer: Tokenizer, decoding, loaded: str) -> None:
    """The chat loop: each line a message or a command, until /exit or the input's end."""
    session = Chat(args, model, tokenizer, decoding)
    interactive = sys.stdin.isatty()
    say(f"{loaded}; /help lists the commands, Ctrl-C stops an answer, Ctrl-D or /exit ends")
    for line in read_lines(interactive):
        if line.startswith("/") and not line.startswith("//"):
            if not session.command(line):
                return
        elif line:
            message = {"role": "user", "content": line.removeprefix("/")}
            session.turn(session.conversation.messages + [message])
