"""Training's checkpoint, so that a kill loses nothing finished.

It is written as every file a long run writes (a self-distillation shard, the heads,
calibration.json): beside its final name and renamed over it (outputs.py), so a kill mid-write
leaves the previous file, never half a new one. It holds the trained tensors, the optimizer and
the log at a step; `resume` reads it back, and `checkpoint_on_interrupt` lets a Ctrl-C end the
step under way so that it is checkpointed. Left out: checkpoints of several files written as
one (each file here stands alone).
"""
import contextlib
import json
import signal
from pathlib import Path

import torch

from minimedusa.errors import UserError
from minimedusa.files.outputs import write_atomically

CHECKPOINT = "checkpoint.pt"  # in the training run's output folder


def save_checkpoint(path: Path, state: dict) -> None:
    """state: the mode's tensors, "step", "optimizer" (its state_dict) and "log" (JSON text)."""
    write_atomically(path, lambda tmp: torch.save(state, tmp))


def resume(mode, path: Path, device, say) -> tuple[int, list]:
    """Restore the mode's tensors and its optimizer from the checkpoint: (step, log so far)."""
    if not path.is_file():
        raise UserError(f"--resume: no checkpoint at {path}")
    state = torch.load(path, map_location=device, weights_only=True)
    mode.load_state(state)
    mode.optimizer.load_state_dict(state["optimizer"])
    say(f"resumed at step {state['step']}")
    return state["step"], json.loads(state["log"])


@contextlib.contextmanager
def checkpoint_on_interrupt(enabled: bool):
    """Inside, the first Ctrl-C only raises a flag (read by calling the yielded function): the
    loop ends its step, writes the checkpoint and stops, so no finished step is lost. A second
    Ctrl-C interrupts at once. Under torchrun (enabled False) the processes could stop at
    different steps, so Ctrl-C stops them at once and the last periodic checkpoint stays."""
    asked = []
    if not enabled:
        yield lambda: False
        return

    def handler(signum, frame):
        asked.append(signum)
        signal.signal(signal.SIGINT, previous)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)
