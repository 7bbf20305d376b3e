"""One answer, decoded as the flags chose, timed and (where asked) streamed: what generate.py's
one prompt, a chat's turns (chat.py) and a file of prompts (prompts.py) share, with the summary
line each prints on stderr. The decoding itself is decoding.py's; this only drives and times it.
"""
import time
from dataclasses import dataclass, field
from typing import Iterator

from minimedusa.decoding import Step, StepStats


@dataclass
class Answer:
    """An answer as it comes: held by the caller, so that one stopped by Ctrl-C still holds
    the tokens that came."""
    ids: list[int] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / max(self.seconds, 1e-9)


def decode_answer(steps: Iterator[Step], answer: Answer, stream=None,
                  start: float | None = None) -> Answer:
    """Drive a decoding (recipe.Decoding.decode's steps, decoding.Step) into `answer`, step by
    step, printing each step's text to stdout as it is accepted if a `stream` is given
    (show.Painted: push(step) -> its text). answer.seconds: from `start` (default: now) to the
    last token, set even where Ctrl-C stops the answer."""
    start = time.perf_counter() if start is None else start
    try:
        for step in steps:
            answer.ids += step.tokens
            answer.stats.record(len(step.tokens))
            if stream is not None:
                print(stream.push(step), end="", flush=True)
    finally:
        answer.seconds = time.perf_counter() - start
        if stream is not None:
            print(stream.flush(), end="", flush=True)
    return answer


def summary_line(mode: str, tokens: int, seconds: float, steps: int, histogram: dict,
                 tail: str) -> str:
    """The numbers that teach, in one line: tokens, seconds, tokens/s, steps, tokens per step
    and their histogram ({tokens a step yielded: steps}); `tail` says the rest (the device and
    format, what was prefilled)."""
    counts = " ".join(f"{n}:{c}" for n, c in sorted(histogram.items()))
    return (f"[{mode}] {tokens} tokens in {seconds:.2f} s: {tokens / max(seconds, 1e-9):.1f} "
            f"tokens/s, {steps} steps, {tokens / max(steps, 1):.2f} tokens/step (tokens per "
            f"step: {counts}) {tail}")
