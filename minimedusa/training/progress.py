"""What the long commands (self-distillation, training, the one-command pipeline) print while
they work: a progress bar with the elapsed and remaining time, and lines that do not break it.
"""
import sys
import time


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def say(msg: str) -> None:
    """A line on stderr; on a terminal it first clears the line a progress bar is drawn on, so
    that the bar goes on below the message."""
    print(("\r\x1b[K" if sys.stderr.isatty() else "") + msg, file=sys.stderr, flush=True)


def progress_bar():
    """show(done, total, line): a bar with the elapsed and the remaining time, then `line`;
    redrawn in place on a terminal (at most every second), else a line at most every 10 s and
    at the end (a log keeps them)."""
    start, terminal = time.time(), sys.stderr.isatty()
    shown = [0.0]  # when it last printed

    def show(done: int, total: int, line: str = "") -> None:
        now = time.time()
        if done < total and now - shown[0] < (1 if terminal else 10):
            return
        shown[0], elapsed = now, now - start
        left = elapsed / max(done, 1) * (total - done)
        bar = "#" * (20 * done // max(total, 1))
        text = (f"[{bar:<20}] {done}/{total}, {minutes(elapsed)} elapsed, {minutes(left)} "
                f"left; {line}")
        end = "\n" if done == total or not terminal else ""
        print(("\r\x1b[K" if terminal else "") + text, end=end, file=sys.stderr, flush=True)
    return show
