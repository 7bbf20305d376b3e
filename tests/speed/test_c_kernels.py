"""Building the C kernels (c_kernels.py) survives what a cache folder goes through: a built
library that is not what its build wrote (cut short, overwritten, an older version's without a
digest) is built again, once, never loaded; a build that fails leaves nothing behind; a cache
folder that cannot be written costs one line, not the kernels. A one-function C file stands in
for the kernels, so that each build takes a moment, but for one run of the real kernel."""
import os
import shutil
import subprocess
import sys

import pytest

from minimedusa.speed import c_kernels, cache_folder
from minimedusa.speed.c_kernels import digest_path, load_library
from helpers import REPO

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                                 reason="no C compiler")]


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


@pytest.mark.parametrize("damage", ["cut short", "garbage", "grown", "no digest", "digest cut",
                                    "digest of another"])
def test_a_kernel_library_unlike_its_build_is_rebuilt_not_loaded(damage, source, monkeypatch):
    built = c_kernels.compile_kernel(source, os.environ.get("CC", "cc"))  # built, not loaded
    whole, digest = built.read_bytes(), digest_path(built).read_text()
    if damage == "cut short":  # a full disk, an interrupted copy: the headers may stay whole
        built.write_bytes(whole[:len(whole) // 2])
    elif damage == "garbage":
        built.write_bytes(b"\x7fELF, then garbage" * 100)
    elif damage == "grown":
        built.write_bytes(whole + b"\0")
    elif damage == "no digest":  # a library an older version built, or its digest lost
        digest_path(built).unlink()
    elif damage == "digest cut":
        digest_path(built).write_text(digest[:10])
    else:
        digest_path(built).write_text(f"{len(whole)} {'0' * 64}\n")
    builds = counted_builds(monkeypatch)
    assert load_library(source).answer() == 42
    assert len(builds) == 1 and built_files() == [built.name, digest_path(built).name]
    assert built.read_bytes() == whole or damage not in ("no digest", "digest cut")
    assert load_library(source).answer() == 42 and len(builds) == 1  # and kept


def test_a_library_its_build_wrote_unloadable_is_an_error_not_a_loop(source, monkeypatch):
    def garbage(source, compiler, out):  # a compiler that writes garbage
        out.write_bytes(b"not a library")
    builds = counted_builds(monkeypatch, garbage)
    with pytest.raises(OSError):
        load_library(source)
    assert len(builds) == 1


def test_a_cut_group_kernel_is_rebuilt_and_multiplies(built_kernels, tmp_path):
    """The real kernel, cut as a full disk leaves it (truncate -s 40000: it loaded, then died of
    a bus error on every run): a fresh process rebuilds it and multiplies."""
    from minimedusa.speed import group_kernel
    if group_kernel.kernel_problem() is not None:
        pytest.skip(f"group_kernel.c does not multiply here: {group_kernel.kernel_problem()}")
    cache = tmp_path / "cache"
    shutil.copytree(built_kernels, cache / built_kernels.name)
    built = c_kernels.compile_kernel(group_kernel.SOURCE, os.environ.get("CC", "cc"))
    # this source's build (older ones may lie beside it)
    library = cache / built_kernels.name / built.name
    whole = library.read_bytes()
    with open(library, "r+b") as f:
        f.truncate(40000)
    product = ("import torch; from minimedusa.speed import group_kernel; "
               "from minimedusa.speed.quantized import Int4KernelLinear; torch.manual_seed(0); "
               "layer = Int4KernelLinear(torch.nn.Linear(64, 32)); x = torch.randn(2, 64, dtype="
               "torch.bfloat16 if group_kernel.multiplies_bfloat16() else torch.float32); "
               "print(bool(layer(x).float().abs().sum() > 0))")
    done = subprocess.run([sys.executable, "-c", product], capture_output=True, text=True,
                          env={**os.environ, "MINIMEDUSA_CACHE": str(cache)}, timeout=300,
                          cwd=REPO)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "True", "")
    assert library.read_bytes() == whole


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


def test_an_unwritable_cache_folder_costs_one_line_not_the_kernels(source, tmp_path, monkeypatch,
                                                                   capsys):
    (tmp_path / "not a folder").write_text("MINIMEDUSA_CACHE naming a file")
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(tmp_path / "not a folder"))
    assert load_library(source).answer() == 42  # built in a folder of the process's own
    assert load_library(source).answer() == 42
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"minimedusa: the cache folder {tmp_path / 'not a folder'} cannot be "
                           "written (") and "set MINIMEDUSA_CACHE" in line
    assert c_kernels.kernels_folder().parent == cache_folder.cache_folder() != tmp_path


def test_a_cache_folder_named_through_a_link_is_made_where_it_points(source, tmp_path,
                                                                      monkeypatch, capsys):
    """MINIMEDUSA_CACHE a link to a folder not made yet (a cache kept on a bigger disk): the
    kernels are built there, without a word, and nothing is left beside the link."""
    target = tmp_path / "big" / "cache"
    (tmp_path / "big").mkdir()
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    monkeypatch.setenv("MINIMEDUSA_CACHE", str(tmp_path / "link"))
    assert load_library(source).answer() == 42
    assert capsys.readouterr().err == ""
    assert c_kernels.kernels_folder().parent == target and any(target.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answer.c", "big", "link"]
