"""--show: watch Medusa decode. Each token of the streamed answer is coloured by where it came
from: the model's own token (the verifier's: each step's last, and every plain step's), a head's
accepted guess (head k guesses depth k of the tree: a colour a depth), a context candidate
(context_candidates.py), or a draft model's guess (speculative_decoding.py).

Watching reads the steps the loop yields (decoding.Step) and nothing else: a token's origin is
its kept node's, as the step's Candidates name it. On a terminal only (and not under NO_COLOR):
elsewhere the text is the same as without --show.
"""
import os
import sys

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


def node_origin(candidates, node: int):
    """What guessed a node of the step's tree: a context chain (CONTEXT), a draft model
    (DRAFT), or head k (k, the node's depth)."""
    path = candidates.tree.nodes[node]
    if path in candidates.context:
        return CONTEXT
    return DRAFT if candidates.drafter == "draft model" else len(path)


def origins(step) -> list:
    """Each of the step's tokens' origin: its kept nodes' (the accepted candidates), then the
    model's own (the verifier's token; every token of a plain step)."""
    kept = step.kept[1:] if step.candidates is not None else []
    said = [node_origin(step.candidates, node) for node in kept] + [MODEL]
    return (said + [MODEL] * len(step.tokens))[:len(step.tokens)]


def colour(origin) -> str:
    if origin == MODEL:
        return ""
    return COLOURS[origin] if origin in COLOURS else HEAD_COLOURS[(origin - 1) % 6]


def ansi(text: str, origin) -> str:
    """A piece of text in its origin's terminal colour (the model's own: as it is)."""
    return f"{colour(origin)}{text}{RESET}" if text and colour(origin) else text


class Painted:
    """The answer's text a step at a time (files/tokenizer.StreamDecoder's), each token painted
    by paint(text, origin) (ansi on a terminal; trace_page's HTML spans), or (paint None) the
    step's text as it is."""

    def __init__(self, stream, paint=None):
        self.stream, self.paint = stream, paint

    def push(self, step) -> str:
        if self.paint is None:
            return self.stream.push(step.tokens)
        return "".join(self.paint(self.stream.push([token]), origin)
                       for token, origin in zip(step.tokens, origins(step)))

    def flush(self) -> str:
        return self.stream.flush()


def painted(stream, show: bool) -> Painted:
    """The stream the answer's text goes through: coloured where --show asks and may colour."""
    return Painted(stream, ansi if show and showing() else None)


def innermost(draft):
    """The draft under a context draft's chains."""
    return draft.draft if isinstance(draft, ContextDraft) else draft


def draft_legend(draft) -> str:
    """One line for stderr: each origin the run's draft can give, in its colour."""
    parts = ["the model's own token"]
    inner = innermost(draft)
    if isinstance(inner, ModelDraft):
        parts.append(f"{COLOURS[DRAFT]}draft model{RESET}")
    else:
        heads = inner.heads.config.medusa_num_heads
        parts += [f"{colour(k)}head {k}{RESET}" for k in range(1, heads + 1)]
    if isinstance(draft, ContextDraft):
        parts.append(f"{COLOURS[CONTEXT]}context candidate{RESET}")
    return "minimedusa: --show: " + ", ".join(parts)


def say_legend(decoding, show: bool) -> None:
    """--show's legend on stderr, once, where it colours a run that has a draft."""
    if show and showing() and decoding.draft is not None:
        print(draft_legend(decoding.draft), file=sys.stderr)
