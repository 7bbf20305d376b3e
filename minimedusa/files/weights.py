"""The model's files: a Llama in the HF folder layout (config.json + model.safetensors).

config.json is read by hf_config.py; the tensors, single file or sharded, are mapped to this
project's module names by an explicit table, and loading is strict: a missing tensor, an
unexpected one or a wrong shape is an error that names it. Any stored dtype is cast to the
requested one. The heads' files are heads_files.py's. No pickle of code anywhere.
"""
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minimedusa.errors import UserError
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


def file_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each (HF name, tensor) of the files, read one at a time, as stored."""
    for f in files:
        try:
            with safe_open(f, framework="pt", device="cpu") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except Exception as e:  # safetensors reports truncation/corruption with varied types
            raise WeightsError(f"cannot read {f} (truncated or corrupt?): {e}") from None


def read_tensors(files: list[Path], device, dtype) -> dict[str, torch.Tensor]:
    return {name: t.to(device=device, dtype=dtype) for name, t in file_tensors(files)}


def match_names(model: Llama, hf_tensors: dict) -> dict[str, torch.Tensor]:
    """Rename HF tensors to ours (stacking those model.py fuses), strictly: every error names
    the tensor as the file does."""
    names = hf_name_map(model.config)
    if model.config.tie_word_embeddings:
        # note: some tied checkpoints store the LM head anyway; it is the embedding, so drop it.
        hf_tensors.pop("lm_head.weight", None)
    missing = [n for n in names if n not in hf_tensors]
    unexpected = [n for n in hf_tensors if n not in names]
    if missing:
        raise WeightsError(f"weights lack tensor {missing[0]}" +
                           (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise WeightsError(f"unexpected tensor {unexpected[0]} in the weights" +
                           (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    shapes = {n: p.shape for n, p in model.state_dict().items()}
    state = {}
    for ours, parts in hf_parts(model.config).items():
        for hf, rows in parts:
            needed = shapes[ours] if rows is None else (rows, *shapes[ours][1:])
            if hf_tensors[hf].shape != needed:
                raise WeightsError(f"tensor {hf} has shape {tuple(hf_tensors[hf].shape)}, "
                                   f"the config needs {tuple(needed)}")
        state[ours] = torch.cat([hf_tensors.pop(hf) for hf, _ in parts])  # one HF tensor: as is
    return state


def load_model(folder, device="cpu", dtype=torch.float32) -> Llama:
    """Build the Llama of folder/config.json and fill it from folder's safetensors."""
    cfg = read_config(folder)
    with torch.device("meta"):  # no memory for random init: every tensor is replaced below
        model = Llama(cfg)
    state = match_names(model, read_tensors(safetensors_files(folder), device, dtype))
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight  # assign=True untied them: one Parameter again
    return model.eval().requires_grad_(False)


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
