"""Building the C kernels (c_kernels.py) survives what a cache folder goes through: a built
library that is damaged is built again, once; a build that fails leaves nothing behind. A
one-function C file stands in for the kernels, so that each build takes a moment."""
import os
import shutil

import pytest

from minimedusa.speed import c_kernels
from minimedusa.speed.c_kernels import load_library

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                                reason="no C compiler")


@pytest.fixture
def source(tmp_path, monkeypatch):
    """A C file of one function, answer() == 42; its builds go to a fresh cache folder."""
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "answer.c"
    path.write_text("int answer(void) { return 42; }\n")
    return path


def counted_builds(monkeypatch, build=c_kernels.build) -> list:
    """Every call of c_kernels.build from now on, through `build`."""
    calls = []

    def counted(*args):
        calls.append(args)
        build(*args)
    monkeypatch.setattr(c_kernels, "build", counted)
    return calls


def built_files() -> list[str]:
    return sorted(os.listdir(c_kernels.kernels_folder()))


def test_a_damaged_kernel_library_is_rebuilt_once(source, monkeypatch):
    built = c_kernels.compile_kernel(source, os.environ.get("CC", "cc"))  # built, not loaded
    built.write_bytes(b"\x7fELF, then garbage" * 100)
    builds = counted_builds(monkeypatch)
    assert load_library(source).answer() == 42
    assert len(builds) == 1 and built_files() == [built.name]  # replaced, no .tmp left
    assert load_library(source).answer() == 42 and len(builds) == 1  # and kept


def test_a_library_still_damaged_after_its_rebuild_is_an_error_not_a_loop(source, monkeypatch):
    def garbage(source, compiler, out):  # a compiler that writes garbage
        out.write_bytes(b"not a library")
    builds = counted_builds(monkeypatch, garbage)
    with pytest.raises(OSError):
        load_library(source)
    assert len(builds) == 2


def test_a_failed_build_leaves_no_file_behind(source, monkeypatch):
    def half_written(source, compiler, out):
        out.write_bytes(b"half a library")
        raise RuntimeError("cc failed (exit status 1)")
    monkeypatch.setattr(c_kernels, "build", half_written)
    with pytest.raises(RuntimeError, match="exit status 1"):
        load_library(source)
    assert built_files() == []


def test_a_failing_compiler_says_how_it_failed(source, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.raises(RuntimeError, match=r"^/bin/false failed \(exit status 1\)$"):
        load_library(source)
    assert built_files() == []
