"""--show: watch Medusa decode. Each token of the streamed answer is coloured by where it came
from: the model's own token (the verifier's: each step's last, and every plain step's), a head's
accepted guess (head k guesses depth k of the tree: a colour a depth), a context candidate
(context_candidates.py), or a draft model's guess (speculative_decoding.py).

Watching observes and never decodes: Watched wraps the run's draft and passes every verb through
unchanged, noting each step's root, candidates and accepted tokens on the way (what the loop
hands the draft anyway); Painted wraps the stream of text and colours each step's tokens by
those notes. On a terminal only (and not under NO_COLOR): elsewhere the text is the same as
without --show.
"""
import os
import sys
from dataclasses import replace

from minimedusa.context_candidates import ContextDraft
from minimedusa.speculative_decoding import ModelDraft

RESET = "\x1b[0m"
MODEL, CONTEXT, DRAFT = "model", "context", "draft"
# head k's colour is HEAD_COLOURS[(k - 1) % 6]; the model's own tokens are left uncoloured
HEAD_COLOURS = ("\x1b[32m", "\x1b[33m", "\x1b[34m", "\x1b[35m", "\x1b[36m", "\x1b[92m")
COLOURS = {CONTEXT: "\x1b[4;31m", DRAFT: "\x1b[36m"}  # context: underlined red


def showing() -> bool:
    """Whether --show may colour: standard output a terminal, and NO_COLOR unset."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


class Watched:
    """A draft (draft.py's five verbs) passed through unchanged, noting for each step the origin
    of each token the loop will yield: (head depth k, CONTEXT, DRAFT or MODEL) a token;
    shown: whether the answer's stream is coloured by them (--show; a trace watches too)."""

    def __init__(self, draft, shown: bool = True):
        self.draft, self.steps, self.chain, self.shown = draft, [], [], shown

    def start(self, prompt_ids, cache) -> None:
        self.steps = [[MODEL]]  # the prefill's token
        self.draft.start(prompt_ids, cache)

    def read(self, hidden):
        return self.draft.read(hidden)

    def match(self, root: int) -> int:
        group = self.draft.match(root)
        self.chain = list(self.draft.chain) if isinstance(self.draft, ContextDraft) else []
        return group

    def tree(self, model, n: int, root: int, features):
        return self.draft.tree(model, n, root, features)

    def extend(self, tokens: list[int]) -> None:
        self.steps.append([self.origin(tokens, depth) for depth in range(1, len(tokens) + 1)]
                          + [MODEL])
        self.draft.extend(tokens)

    def origin(self, accepted: list[int], depth: int):
        """What guessed the accepted token at this depth: the context chain (where the path so
        far is the chain's), a draft model, or head `depth`."""
        if self.chain[:depth] == accepted[:depth]:
            return CONTEXT
        return DRAFT if isinstance(self.draft, ModelDraft) else depth

    def __getattr__(self, name):  # the draft's own state (a budget's, a summary's), as it is
        return getattr(self.draft, name)


def colour(origin) -> str:
    if origin == MODEL:
        return ""
    return COLOURS[origin] if origin in COLOURS else HEAD_COLOURS[(origin - 1) % 6]


def ansi(text: str, origin) -> str:
    """A piece of text in its origin's terminal colour (the model's own: as it is)."""
    return f"{colour(origin)}{text}{RESET}" if text and colour(origin) else text


class Painted:
    """The answer's stream (files/tokenizer.StreamDecoder) with each token painted by its
    origin (ansi; the trace's page paints in HTML): a step's tokens pushed one by one, the
    watch's notes read step by step (never consumed: a trace reads them again)."""

    def __init__(self, stream, watched: Watched, paint=ansi):
        self.stream, self.watched, self.paint, self.step = stream, watched, paint, 0

    def push(self, ids: list[int]) -> str:
        steps = self.watched.steps
        origins = steps[self.step] if self.step < len(steps) else []
        self.step += 1
        origins = origins + [MODEL] * (len(ids) - len(origins))
        return "".join(self.paint(self.stream.push([token]), origin)
                       for token, origin in zip(ids, origins))

    def flush(self) -> str:
        return self.stream.flush()


def watched(decoding):
    """The decoding with its draft Watched (already so where a trace watches it), and the
    legend said once on stderr, where --show may colour (showing); else as it is (plain
    decoding has no draft: every token is the model's)."""
    if decoding.draft is None or not showing():
        return decoding
    print(legend(decoding.draft), file=sys.stderr)
    if isinstance(decoding.draft, Watched):
        decoding.draft.shown = True
        return decoding
    return replace(decoding, draft=Watched(decoding.draft))


def painted(decoding, stream):
    """The stream the answer's text goes through: coloured where --show may colour."""
    if isinstance(decoding.draft, Watched) and decoding.draft.shown and showing():
        return Painted(stream, decoding.draft)
    return stream


def innermost(draft):
    """The draft under a context draft's chains."""
    return draft.draft if isinstance(draft, ContextDraft) else draft


def legend(draft) -> str:
    """One line for stderr: each origin the draft can give, in its colour."""
    parts = ["the model's own token"]
    draft = draft.draft if isinstance(draft, Watched) else draft
    inner = innermost(draft)
    if isinstance(inner, ModelDraft):
        parts.append(f"{COLOURS[DRAFT]}draft model{RESET}")
    else:
        heads = inner.heads.config.medusa_num_heads
        parts += [f"{colour(k)}head {k}{RESET}" for k in range(1, heads + 1)]
    if isinstance(draft, ContextDraft):
        parts.append(f"{COLOURS[CONTEXT]}context candidate{RESET}")
    return "minimedusa: --show: " + ", ".join(parts)
