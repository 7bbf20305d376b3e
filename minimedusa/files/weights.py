"""The model's files: a Llama in the HF folder layout (config.json + model.safetensors).

config.json is read by hf_config.py; the tensors, single file or sharded, are mapped to this
project's module names by an explicit table, and loading is strict: a missing tensor, an
unexpected one or a wrong shape is an error that names it. Any stored dtype is cast to the
requested one, or kept. The model is read a block at a time, a weight format applied to each as
it comes (load_model's convert_block), each tensor from a file opened for it alone. The heads'
files are heads_files.py's. No pickle of code anywhere.
"""
import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from minimedusa.errors import UserError, unreadable
from minimedusa.files.hf_config import ConfigError, config_from_hf, config_to_hf
from minimedusa.model import Llama, LlamaConfig


class WeightsError(UserError):
    """A model folder or weights file that cannot be loaded as the config describes."""


# HF name inside model.layers.{i}  ->  name inside this project's layers.{i}. Several HF tensors
# map to one of ours where model.py runs their products as one (q, k, v; gate, up): they are
# stacked along the output rows in the order listed here.
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.wqkv.weight",
    "self_attn.k_proj.weight": "attn.wqkv.weight",
    "self_attn.v_proj.weight": "attn.wqkv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_up.weight",
    "mlp.up_proj.weight": "mlp.gate_up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
QKV_BIAS_NAMES = {  # the same, for the biases of a config with qkv_bias (Qwen2)
    "self_attn.q_proj.bias": "attn.wqkv.bias",
    "self_attn.k_proj.bias": "attn.wqkv.bias",
    "self_attn.v_proj.bias": "attn.wqkv.bias",
}


def hf_name_map(cfg: LlamaConfig) -> dict[str, str]:
    """Every tensor an HF checkpoint of this config holds -> our parameter name."""
    names = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    layer_names = LAYER_NAMES | (QKV_BIAS_NAMES if cfg.qkv_bias else {})
    for i in range(cfg.num_hidden_layers):
        for hf, ours in layer_names.items():
            names[f"model.layers.{i}.{hf}"] = f"layers.{i}.{ours}"
    return names


def hf_parts(cfg: LlamaConfig) -> dict[str, list[tuple[str, int | None]]]:
    """Our parameter name -> the HF tensors it stacks, in order, each with its rows (None: one
    HF tensor is the whole parameter)."""
    H, G, D, I = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                  cfg.intermediate_size)
    fused_rows = {"attn.wqkv": [H * D, G * D, G * D], "mlp.gate_up": [I, I]}  # model.py's
    parts = {}
    for hf, ours in hf_name_map(cfg).items():
        parts.setdefault(ours, []).append(hf)
    # "layers.{i}.attn.wqkv.weight" -> "attn.wqkv"
    return {ours: list(zip(hfs, fused_rows.get(".".join(ours.split(".")[2:4]), [None])))
            for ours, hfs in parts.items()}


def read_config(folder: Path) -> LlamaConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise WeightsError(f"no config.json in {folder}")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return config_from_hf(hf)


def safetensors_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards listed by model.safetensors.index.json."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = [folder / shard for shard in index_shards(index)]
    else:
        files = [folder / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise WeightsError(f"missing weights file {f}")
    return files


def index_shards(index: Path) -> list[str]:
    """The shard files a model.safetensors.index.json names: file names in its own folder (a
    shard named by a path, ../ or absolute, is refused: a model folder reads only itself)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (UnicodeDecodeError, ValueError, AttributeError):  # AttributeError: not an object
        weight_map = None
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(shard, str) for shard in weight_map.values())):
        raise WeightsError(f"{index} is not a safetensors index: a JSON object whose "
                           "\"weight_map\" maps each tensor's name to its shard's file name")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise WeightsError(f"{index} names the shard {shard!r}, which is not a file name in "
                               f"{index.parent}: shards are read from the model's folder only")
    return shards


def tensor_files(files: list[Path]) -> dict[str, Path]:
    """Each tensor's HF name -> the file that holds it, from the files' headers alone."""
    where = {}
    for f in files:
        try:
            with safe_open(f, framework="pt", device="cpu") as st:
                where.update((name, f) for name in st.keys())
        except Exception as e:  # safetensors reports truncation/corruption with varied types
            raise WeightsError(unreadable(f, e)) from None
    return where


def check_names(cfg: LlamaConfig, where: dict[str, Path]) -> None:
    """Strictly the tensors the config needs, before any is read: every error names the tensor
    as the file does."""
    names = hf_name_map(cfg)
    # note: some tied checkpoints store the LM head anyway; it is the embedding, so it is ignored
    stored = [n for n in where if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    missing = [n for n in names if n not in where]
    unexpected = [n for n in stored if n not in names]
    if missing:
        raise WeightsError(f"weights lack tensor {missing[0]}" +
                           (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise WeightsError(f"unexpected tensor {unexpected[0]} in the weights" +
                           (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor, read from its file (opened for it alone: the file's pages are not kept
    mapped, and counted in the process's memory, beyond this read)."""
    try:
        with safe_open(path, framework="pt", device="cpu") as st:
            return st.get_tensor(name)
    except Exception as e:  # safetensors reports truncation/corruption with varied types
        raise WeightsError(unreadable(path, e)) from None


def read_parameter(parts: list[tuple[str, int | None]], where: dict[str, Path],
                   shape: torch.Size, device, dtype) -> torch.Tensor:
    """One of our parameters from its HF tensors (stacked along the rows where model.py fuses
    them), each checked against the shape the config needs, in `dtype` (None: as stored)."""
    pieces = []
    for hf, rows in parts:
        t = read_tensor(where[hf], hf)
        needed = shape if rows is None else (rows, *shape[1:])
        if t.shape != needed:
            raise WeightsError(f"tensor {hf} has shape {tuple(t.shape)}, the config needs "
                               f"{tuple(needed)}")
        check_values(t, hf, where[hf])
        # copy=True: a tensor as get_tensor gives it lies in a mapping of its whole file, which
        # it keeps mapped as long as it lives (the default model's 272 tensors in float32
        # reserved 65 GB of address space, 272 maps of its 0.54 GB file: refused under a
        # memory limit, ulimit -v); a copy lets the file's map go with the read
        pieces.append(t.to(device=device, dtype=dtype or t.dtype, copy=True))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def check_values(t: torch.Tensor, name: str, path: Path) -> None:
    """A weight is floating point and finite: a file of bools or ints, or one holding NaN or
    inf (a training run that diverged, a bad conversion), is named here, as it streams in (one
    pass over each tensor), not met later as a traceback or a text of garbage."""
    if not t.is_floating_point():
        raise WeightsError(f"tensor {name} in {path} is stored as {str(t.dtype)[6:]}: a model's "
                           "weights are floating point")
    if not torch.isfinite(t).all():
        raise WeightsError(f"tensor {name} in {path} holds NaN or inf: these weights cannot "
                           "decode (a diverged training run, or a broken conversion?)")


def load_model(folder, device="cpu", dtype=torch.float32, convert_block=None,
               kept_blocks=None, convert_head=None) -> Llama:
    """Build the Llama of folder/config.json and fill it from folder's safetensors, a piece at a
    time (each block, the final norm, the embedding, the LM head), each tensor in `dtype` (None:
    as the file stores it). convert_block(block), where given, changes each block in place as
    soon as it is read (a weight format applied while loading: speed/weight_formats.py's
    block_format), so that the model is never held whole in its file's dtype: a model loads in
    int4 in its int4 bytes and one block's more. kept_blocks, where given, fills each block as a
    previous run's convert_block left it (speed/kept_weights.py), instead of the files.
    convert_head(lm_head, config), where given, makes an untied LM head, read as the file
    stores it, the layer decoding multiplies with (weight_formats.head_format: rounded to 8
    bits before a float32 copy of it is ever made)."""
    cfg = read_config(folder)
    with torch.device("meta"):  # no memory for random init: every tensor is replaced below
        model = Llama(cfg).eval().requires_grad_(False)
    where = tensor_files(safetensors_files(folder))
    check_names(cfg, where)
    parts, shapes = hf_parts(cfg), {n: p.shape for n, p in model.state_dict().items()}

    def fill(module: nn.Module, prefix: str, as_dtype=dtype) -> None:
        module.load_state_dict({name: read_parameter(parts[prefix + name], where,
                                                     shapes[prefix + name], device, as_dtype)
                                for name in module.state_dict()}, strict=True, assign=True)
    for i, block in enumerate(model.layers):
        if kept_blocks is not None:
            kept_blocks.fill(i, block)
            continue
        fill(block, f"layers.{i}.")
        if convert_block is not None:
            convert_block(block)
    fill(model.norm, "norm.")
    fill(model.embed, "embed.")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight  # one Parameter, as Llama() ties them
    elif convert_head is None:
        fill(model.lm_head, "lm_head.")
    else:
        fill(model.lm_head, "lm_head.", None)
        model.lm_head = convert_head(model.lm_head, cfg)
    return model.requires_grad_(False)


def save_model(model: Llama, folder) -> None:
    """Write config.json + model.safetensors in the HF layout (what load_model reads)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ours, state = model.state_dict(), {}
    for name, parts in hf_parts(model.config).items():
        pieces = [ours[name]] if len(parts) == 1 else ours[name].split([r for _, r in parts])
        state.update({hf: t.contiguous() for (hf, _), t in zip(parts, pieces)})
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
