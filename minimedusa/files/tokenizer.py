"""Text <-> token ids: the model folder's tokenizer.json (the `tokenizers` library), its own chat
template (jinja2, sandboxed), and a streaming decoder that turns ids into text as they are
accepted.

The chat template renders as transformers' apply_chat_template renders it (its tojson,
strftime_now and raise_exception), under a budget: a template is a program from the model's
folder, and one that loops or allocates without end costs one line, not the machine. Left out:
its {% generation %} tag, which marks the assistant's tokens for training masks; a template
that uses it fails to parse, in one clear error.
"""
import contextlib
import functools
import json
import resource
import signal
import threading
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from minimedusa.errors import UserError, json_kind

# the tokens a chat template may name (tokenizer_config.json: a string or {"content": ...})
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def render_chat(template: str, messages: list[dict], variables: dict) -> str:
    """The chat as the model's own template (jinja, from its tokenizer_config.json) renders it,
    with add_generation_prompt=True, as transformers' apply_chat_template does (checked against
    it for Llama 3, Qwen2.5 and Mistral templates in tests/test_tokenizer.py). `variables` are
    the other names the template reads: the special tokens (bos_token, ...), and where a caller
    has them, `tools` (function schemas) or Llama 3's `date_string`.

    >>> render_chat("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    ...             "{% if add_generation_prompt %}<assistant>{% endif %}",
    ...             [{"role": "user", "content": "Hi"}], {})
    '<user>Hi<assistant>'
    """
    # as apply_chat_template: a key set to None is dropped (templates test `is defined`, and
    # would print "None"), and tools and documents are always defined, None unless given
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    context = {"tools": None, "documents": None, **variables,
               "messages": messages, "add_generation_prompt": True}
    try:
        with render_budget(TEMPLATE_SECONDS, TEMPLATE_BYTES):
            return capped(chat_environment().from_string(template).generate(context))
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        # a template is a program: its own type errors (None + a string) are its failure too;
        # one line, even where the template's raise_exception message spans several
        raise UserError("the model's chat template failed to render: "
                        + " | ".join(line.strip() for line in str(e).splitlines())) from None
    except (OverflowError, MemoryError, RecursionError, TemplateTimeout) as e:
        raise UserError(f"the model's chat template exceeded its budget ({budget_problem(e)}): "
                        "see chat_template in its tokenizer_config.json") from None


# A chat template's budget: what a template that renders a conversation never comes near, and
# a runaway one meets in seconds. Its output's length, its time, and the memory it may take
# beyond what the process holds (where the system sets such limits: POSIX, the main thread).
TEMPLATE_CHARS = 1 << 22  # 4 M characters: about a million tokens
TEMPLATE_SECONDS = 10.0
TEMPLATE_BYTES = 1 << 30


class TemplateTimeout(Exception):
    pass


def capped(pieces) -> str:
    """The pieces a template writes, joined, or an OverflowError past TEMPLATE_CHARS."""
    out, length = [], 0
    for piece in pieces:
        out.append(piece)
        length += len(piece)
        if length > TEMPLATE_CHARS:
            raise OverflowError(f"its output passed {TEMPLATE_CHARS:,} characters")
    return "".join(out)


def budget_problem(e: Exception) -> str:
    if isinstance(e, MemoryError):
        return f"it asked for more than {TEMPLATE_BYTES >> 20} MB"
    if isinstance(e, RecursionError):
        return "it recursed without end"
    return str(e).splitlines()[0] if str(e) else type(e).__name__


@contextlib.contextmanager
def render_budget(seconds: float, extra_bytes: int):
    """Inside: a TemplateTimeout after `seconds`, and a MemoryError for an allocation that would
    take the process's address space `extra_bytes` past its size on entry. Only where POSIX
    lets a program set them on itself, from the main thread (signals go there); elsewhere the
    output cap and the sandbox's range bound remain."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def timeout(signum, frame):
        raise TemplateTimeout(f"it ran past {seconds:g} s")
    previous = signal.signal(signal.SIGALRM, timeout)
    limits = resource.getrlimit(resource.RLIMIT_AS)
    size = address_space_bytes()
    if size is not None and (limits[0] == resource.RLIM_INFINITY or limits[0] > size):
        cap = size + extra_bytes
        if limits[1] != resource.RLIM_INFINITY:
            cap = min(cap, limits[1])
        resource.setrlimit(resource.RLIMIT_AS, (cap, limits[1]))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, limits)


def address_space_bytes() -> int | None:
    """This process's virtual size (Linux's /proc), or None where it cannot be read."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def chat_environment() -> ImmutableSandboxedEnvironment:
    """jinja2 set up as transformers sets it up for chat templates. In the sandbox: a template is
    code from the model's folder, and the sandbox lets it format strings, nothing else."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])  # {% break %}
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = template_exception
    env.globals["strftime_now"] = strftime_now
    return env


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson, the one templates are written against. jinja2's own sorts the keys
    and writes ü as \\u00fc and <, >, &, ' as \\u003c...: Qwen2.5 and Llama 3 write the tool
    schemas with it, so the model would see them reordered and escaped, unlike its training."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    """Local time now, formatted: Llama 3.2's template writes strftime_now("%d %b %Y") as
    `Today Date: 26 Jul 2024` in its system turn, unless the caller passes date_string."""
    return datetime.now().strftime(fmt)


def check_unicode(text: str) -> None:
    """Refuse text that no UTF-8 can hold: a lone surrogate, which is how Python passes on the
    bytes of an argument or a line that were not UTF-8 (surrogateescape), or a JSON string's
    "\\udc80". The tokenizer would stop with a TypeError."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(f"the text is not valid UTF-8 ({text[e.start]!r} at character "
                            f"{e.start}: bytes that are not UTF-8, or a lone surrogate): give "
                            "UTF-8 text") from None


def template_exception(message: str):
    raise jinja2.TemplateError(message)


def read_json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"cannot read {path} as JSON: {e}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds {json_kind(value)}, not a JSON object")
    return value


def parsed(path: Path) -> HFTokenizer:
    """tokenizer.json parsed, once a process for the file as it is (its size and time: a file
    changed is parsed again): a process that loads a model several times (bench's engines, a
    test suite) parses the 2 MB file once, not ~0.1 s each time. Shared: nothing here changes a
    parsed tokenizer."""
    stat = path.stat()
    return _parse(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _parse(path: str, size: int, mtime_ns: int) -> HFTokenizer:
    return HFTokenizer.from_file(path)


@functools.lru_cache(maxsize=8)
def largest_id(tk: HFTokenizer) -> int:
    """The largest token id the tokenizer gives, added tokens included."""
    return max(tk.get_vocab(with_added_tokens=True).values())


@functools.lru_cache(maxsize=8)
def longest_token(tk: HFTokenizer) -> int:
    """The most UTF-8 bytes a token's string holds, added tokens included: no token covers
    more of a text's characters (a byte-level token's string is a character a byte; others'
    are their text, or less)."""
    return max(len(token.encode("utf-8")) for token in tk.get_vocab(with_added_tokens=True))


class Tokenizer:
    def __init__(self, tk: HFTokenizer, chat_template: str | None, special_tokens: dict):
        self.tk = tk
        self.chat_template = chat_template  # the jinja source, or None
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<|im_start|>", ...}

    @classmethod
    def from_folder(cls, folder) -> "Tokenizer":
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise UserError(f"no tokenizer.json in {folder}")
        path = folder / "tokenizer_config.json"
        config = read_json_object(path) if path.is_file() else {}
        special = {k: v.get("content") if isinstance(v, dict) else v
                   for k, v in config.items() if k in SPECIAL_TOKENS}
        try:
            tk = parsed(folder / "tokenizer.json")
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise UserError(f"cannot read {folder / 'tokenizer.json'}: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        return cls(tk, config.get("chat_template"), special)

    def encode(self, text: str) -> list[int]:
        check_unicode(text)
        return self.tk.encode(text, add_special_tokens=False).ids

    def fewest_tokens(self, text: str) -> int:
        """A bound from below on the tokens `text` encodes to, from its length alone (no pass
        over it): each token covers at most longest_token characters, twice that where a
        normalizer composes two characters into one."""
        return len(text) // (2 * longest_token(self.tk))

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special)

    def chat_prompt(self, messages: list[dict]) -> str:
        if not isinstance(self.chat_template, str):  # absent, or a list of named templates
            raise UserError("this model's tokenizer_config.json has no chat_template to render "
                            "the chat with (generate.py takes a prompt as is with --raw)")
        return render_chat(self.chat_template, messages, self.special_tokens)

    def user_turn_opening(self) -> str:
        """The chat up to where a user's words begin (SmolLM2: its system turn, then
        `<|im_start|>user\n`): what the model continues when it writes a user turn itself."""
        marker = "\x00user words\x00"  # text no template writes by itself
        text = self.chat_prompt([{"role": "user", "content": marker}])
        return text[:text.index(marker)]


class StreamDecoder:
    """Text pieces from token ids as they arrive, decoding only a small window each time.

    Re-decoding the whole output every step would be quadratic. Byte-level BPE can split one
    UTF-8 character over several tokens, so a piece whose decoding ends in U+FFFD (an
    incomplete character) is held back until the next tokens complete it.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window decoded each time begins here ...
        self.done = 0  # ... and its text up to here has been emitted already

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.unemitted()
        if text.endswith("\ufffd"):
            return ""
        self.start, self.done = self.done, len(self.ids)
        return text

    def flush(self) -> str:
        """Whatever is still held back when the output ends (bytes that never became valid
        UTF-8 are shown as U+FFFD, as the full decode shows them)."""
        text = self.unemitted()
        self.start = self.done = len(self.ids)
        return text

    def unemitted(self) -> str:
        """The text of the tokens after `done`. The window starts at the previous emission,
        not at `done`, so that a character whose bytes straddle `done` decodes whole."""
        emitted = self.tokenizer.decode(self.ids[self.start:self.done], skip_special=True)
        window = self.tokenizer.decode(self.ids[self.start:], skip_special=True)
        return window[len(emitted):]
