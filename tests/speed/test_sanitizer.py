"""A sanitized test run speaks where CI reads it: through a pipe, pytest's summary line when the
kernels are sound, and AddressSanitizer's report, naming the file and line, when one writes out
of bounds (a write planted into a copy of a kernel, built into a cache folder of the test's own,
never the user's). Both are child processes, as `MINIMEDUSA_SANITIZE=address python -m pytest
-q -m kernels > log 2>&1` runs: the run re-executes itself with the sanitizer's runtime, and
before probes-8 the new process wrote into pytest's capture files, so the log held nothing."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import REPO
from minimedusa.speed import c_kernels

KERNEL = c_kernels.HERE / "attention_kernel.c"
# one byte written before the output buffer, at every row's first value
STORE = "static inline void store_value(void* p, int64_t i, float f, int bf16) {\n"
PLANTED = "  if (i == 0) ((unsigned char*)p)[-1] = 0; /* planted */\n"


def sanitized_run(cache) -> subprocess.CompletedProcess:
    """The attention kernel's tests, instrumented, their output into one pipe (as CI's log)."""
    env = dict(os.environ, MINIMEDUSA_SANITIZE="address", MINIMEDUSA_CACHE=str(cache))
    env.pop("LD_PRELOAD", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "kernels",
                           "-p", "no:cacheprovider", str(REPO / "tests" / "speed" /
                                                         "test_attention_kernel.py")],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=1800)


def plant_write(folder, monkeypatch) -> int:
    """A copy of attention_kernel.c (and the headers beside it) with a write out of bounds,
    built where the sanitized build of the real one is looked for in the cache `folder`'s
    kernels, with its digest: the next run loads it as the kernel. Returns the planted line."""
    monkeypatch.setenv("MINIMEDUSA_SANITIZE", "address")
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(folder))
    copy = folder / "planted"
    copy.mkdir()
    for header in c_kernels.HERE.glob("*.h"):
        shutil.copy(header, copy)
    text = KERNEL.read_text()
    assert text.count(STORE) == 1, "store_value's first line moved: update the plant"
    text = text.replace(STORE, STORE + PLANTED)
    (copy / KERNEL.name).write_text(text)
    target = c_kernels.kernel_path(KERNEL, os.environ.get("CC", "cc"))
    assert target.is_file(), "the clean run built the kernel where the planted one goes"
    c_kernels.build(copy / KERNEL.name, os.environ.get("CC", "cc"), target)
    c_kernels.write_digest(target, c_kernels.file_digest(target))
    return text.splitlines().index(PLANTED.rstrip("\n")) + 1


@pytest.mark.slow
def test_a_sanitized_run_prints_its_summary_and_a_planted_writes_report_through_a_pipe(
        tmp_path, monkeypatch):
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the kernels do not run here")
    clean = sanitized_run(tmp_path)
    lines = clean.stdout.strip().splitlines()
    assert clean.returncode == 0, clean.stdout[-3000:]
    assert lines and re.search(r"\d+ passed", lines[-1]), clean.stdout[-3000:]
    line = plant_write(tmp_path, monkeypatch)
    planted = sanitized_run(tmp_path)
    assert planted.returncode != 0
    assert "ERROR: AddressSanitizer" in planted.stdout, planted.stdout[-3000:]
    assert f"{KERNEL.name}:{line}" in planted.stdout, planted.stdout[-3000:]
