"""The files on disk: a Llama in the HF folder layout, and Medusa heads in the reference's.

Model: config.json + model.safetensors (single or sharded). The HF tensor names are mapped to
this project's module names by an explicit table, and loading is strict: a missing tensor, an
unexpected one or a wrong shape is an error that names it. Any stored dtype is cast to the
requested one.
Heads: config.json + medusa_lm_head.safetensors with the Medusa reference's keys
({i}.{j}.linear.weight, {i}.{j}.linear.bias, {i}.{L}.weight), so heads move between this project
and others; the reference's published medusa_lm_head.pt loads too (plain tensors only), and
`python -m minimedusa.weights SRC OUT` exports heads in the reference's "V1" layout (own
projections) that serving engines load.
No pickle of code anywhere.
"""
import argparse
import json
import os
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from minimedusa.default_model import ensure_default_model
from minimedusa.errors import UserError, entry_point
from minimedusa.heads import MedusaConfig, MedusaHeads
from minimedusa.hydra import HydraHeads
from minimedusa.model import Llama, LlamaConfig

HEADS_FILE = "medusa_lm_head.safetensors"
HEAD_KINDS = {"medusa": MedusaHeads, "hydra": HydraHeads}  # config.json's head_kind -> class
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # token ids by frequency in the training answers


class ConfigError(UserError):
    """A config.json that does not describe a Llama this code can run."""


class WeightsError(UserError):
    """A model folder or weights file that cannot be loaded as the config describes."""


class HeadsError(UserError):
    """Heads that cannot be loaded, or that do not fit the model."""


# --- the model ---------------------------------------------------------------------------------

# model_type -> architecture: the HF families this Llama runs. Each is a Llama but for a few
# lines: Qwen2 puts biases on the q, k, v projections; Mistral attends within a sliding window,
# and within it (config_from_hf caps the context there) a Mistral IS a Llama.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}
# the RoPE scalings model.rope_frequencies implements -> the keys each reads (HF's names)
ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                            "original_max_position_embeddings")}
# the sliding_window of MistralConfig and Qwen2Config when config.json states none
HF_DEFAULT_WINDOW = 4096


def family(hf: dict) -> str:
    """config.json's model_type, checked against its architectures and FAMILIES."""
    model_type = hf.get("model_type", "llama")
    architectures = hf.get("architectures") or [FAMILIES.get(model_type)]
    if model_type not in FAMILIES or FAMILIES[model_type] not in architectures:
        raise ConfigError(f"config.json describes model_type={model_type!r} "
                          f"architectures={architectures}, but minimedusa only runs "
                          f"{', '.join(FAMILIES.values())}")
    return model_type


def rope_scaling(hf: dict) -> dict | None:
    """The RoPE scaling config.json asks for, as {"rope_type": ..., ROPE_SCALINGS' keys}, or None.

    transformers 4 writes it as rope_scaling, transformers 5 inside rope_parameters ("type" is
    the old name of "rope_type"). A scaling not implemented is refused, never ignored: ignoring
    it would change every logit without a word."""
    asked = {}  # config key -> the scaling it asks for (None: the default RoPE)
    for key in ("rope_parameters", "rope_scaling"):
        source = hf.get(key)
        if not source:
            continue
        kind = source.get("rope_type", source.get("type", "default"))
        if kind != "default" and kind not in ROPE_SCALINGS:
            raise ConfigError(f"config.json's {key} asks for RoPE scaling {kind!r}, which "
                              f"minimedusa's Llama does not implement (only "
                              f"{', '.join(map(repr, ROPE_SCALINGS))})")
        missing = [k for k in ROPE_SCALINGS.get(kind, ()) if k not in source]
        if missing:
            raise ConfigError(f"config.json's {key} asks for RoPE scaling {kind!r} but lacks "
                              f"{', '.join(missing)}")
        asked[key] = None if kind == "default" else {
            "rope_type": kind, **{k: source[k] for k in ROPE_SCALINGS[kind]}}
    if len(asked) == 2 and asked["rope_parameters"] != asked["rope_scaling"]:
        raise ConfigError("config.json's rope_parameters and rope_scaling ask for different RoPE "
                          "scalings: which one the model was trained with is unclear")
    return next(iter(asked.values()), None)


def rope_settings(hf: dict) -> dict:
    """{"rope_theta": theta, "rope_scaling": ...} (each left out for the default) from
    transformers 4's top-level keys or transformers 5's rope_parameters. A partial rotary factor
    is refused, never ignored."""
    params = hf.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"config.json sets partial_rotary_factor={partial}, which "
                          "minimedusa's Llama does not implement")
    top, nested = hf.get("rope_theta"), params.get("rope_theta")
    if top is not None and nested is not None and top != nested:
        raise ConfigError(f"config.json sets rope_theta={top} and rope_parameters.rope_theta="
                          f"{nested}: which one the model was trained with is unclear")
    theta, scaling = (nested if nested is not None else top), rope_scaling(hf)
    return ({} if theta is None else {"rope_theta": theta}) | \
        ({} if scaling is None else {"rope_scaling": scaling})


def attention_window(hf: dict, model_type: str) -> int | None:
    """The sliding window some layers attend within, or None where all see the whole context.

    Mistral: sliding_window (null: none). Qwen2: sliding_window only with use_sliding_window
    (transformers then windows only the layers from max_window_layers on; capping the context
    at the window is right whichever layers do)."""
    if model_type == "mistral" or (model_type == "qwen2" and hf.get("use_sliding_window")):
        return hf.get("sliding_window", HF_DEFAULT_WINDOW)
    return None


def context_length(hf: dict, model_type: str) -> int:
    """max_position_embeddings, capped at the sliding window where there is one.

    note: beyond its window a token attends only to the last `window` tokens, which this Llama
    does not compute. Within it the window changes nothing, so the context is capped there:
    decoding.new_cache then refuses a longer prompt + answer with its "prompt too long" error,
    which names the context, instead of computing something else without a word."""
    window = attention_window(hf, model_type)
    context = hf["max_position_embeddings"]
    return context if window is None else min(context, window)


def check_unsupported(hf: dict, model_type: str) -> None:
    """Refuse the switches that would change the computation in ways not implemented here."""
    unsupported = {"hidden_act": hf.get("hidden_act", "silu") != "silu" and hf["hidden_act"]}
    if model_type == "llama":  # only Llama has these switches (Qwen2 and Mistral fix them)
        # note: Llama's attention_bias puts a bias on the output projection too, Qwen2's never
        unsupported |= {"attention_bias": hf.get("attention_bias"), "mlp_bias": hf.get("mlp_bias")}
    for key, value in unsupported.items():
        if value:
            raise ConfigError(f"config.json sets {key}={value!r}, which minimedusa's Llama "
                              "does not implement")


def config_from_hf(hf: dict) -> LlamaConfig:
    """Read an HF-style config.json dict (transformers 4 or 5; Llama, Mistral or Qwen2); keys
    that do not change the computation are ignored, missing ones and ones that would are an
    error."""
    model_type = family(hf)
    check_unsupported(hf, model_type)
    missing = [f.name for f in fields(LlamaConfig) if f.default is MISSING and f.name not in hf]
    if missing:
        raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
    if hf["num_attention_heads"] % hf["num_key_value_heads"]:
        raise ConfigError(f"num_attention_heads={hf['num_attention_heads']} is not a multiple "
                          f"of num_key_value_heads={hf['num_key_value_heads']}")
    known = {f.name for f in fields(LlamaConfig)} - {"rope_theta", "rope_scaling", "qkv_bias"}
    plain = {k: v for k, v in hf.items() if k in known and v is not None}
    return LlamaConfig(**plain | {"max_position_embeddings": context_length(hf, model_type)},
                       qkv_bias=model_type == "qwen2", **rope_settings(hf))


def config_to_hf(cfg: LlamaConfig) -> dict:
    """The config.json that HF tools (and config_from_hf) read back: a Qwen2 when the q, k, v
    projections have biases (HF's Llama has no such switch), else a Llama. A Mistral is written
    as the Llama it is within its capped context."""
    model_type = "qwen2" if cfg.qkv_bias else "llama"
    hf = {k: v for k, v in asdict(cfg).items() if k != "qkv_bias"}
    return hf | {"architectures": [FAMILIES[model_type]], "model_type": model_type,
                 "hidden_act": "silu"}


# HF name inside model.layers.{i}  ->  name inside this project's layers.{i}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
QKV_BIAS_NAMES = {  # the same, for the biases of a config with qkv_bias (Qwen2)
    "self_attn.q_proj.bias": "attn.wq.bias",
    "self_attn.k_proj.bias": "attn.wk.bias",
    "self_attn.v_proj.bias": "attn.wv.bias",
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


def read_config(folder: Path) -> LlamaConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise WeightsError(f"no config.json in {folder}")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return config_from_hf(hf)


def safetensors_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards listed by model.safetensors.index.json."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    else:
        files = [folder / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise WeightsError(f"missing weights file {f}")
    return files


def read_tensors(files: list[Path], device, dtype) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in files:
        try:
            with safe_open(f, framework="pt", device="cpu") as st:
                for name in st.keys():
                    tensors[name] = st.get_tensor(name).to(device=device, dtype=dtype)
        except Exception as e:  # safetensors reports truncation/corruption with varied types
            raise WeightsError(f"cannot read {f} (truncated or corrupt?): {e}") from None
    return tensors


def match_names(model: Llama, hf_tensors: dict) -> dict[str, torch.Tensor]:
    """Rename HF tensors to ours, strictly: every error names the tensor as the file does."""
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
    for hf, ours in names.items():
        if hf_tensors[hf].shape != shapes[ours]:
            raise WeightsError(f"tensor {hf} has shape {tuple(hf_tensors[hf].shape)}, "
                               f"the config needs {tuple(shapes[ours])}")
    return {names[n]: t for n, t in hf_tensors.items()}


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
    ours_to_hf = {ours: hf for hf, ours in hf_name_map(model.config).items()}
    state = {ours_to_hf[n]: t.contiguous() for n, t in model.state_dict().items() if n in ours_to_hf}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")


# --- the heads ---------------------------------------------------------------------------------

def check_heads_fit(cfg: MedusaConfig, model_config: LlamaConfig) -> None:
    for field in ("hidden_size", "vocab_size"):
        ours, theirs = getattr(cfg, field), getattr(model_config, field)
        if ours != theirs:
            raise HeadsError(f"the heads' {field} is {ours} but the model's is {theirs}: "
                             "these heads were trained for another model")


def save_heads(heads: MedusaHeads, folder, extra_config: dict | None = None) -> None:
    """The tensors, then config.json, each written beside its name and renamed: a folder with a
    config.json holds whole heads (train.py's pipeline takes it as training's end)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # heads.heads alone: not a draft vocabulary set for decoding (a slice of the LM head)
    state = {name: t.contiguous() for name, t in heads.heads.state_dict().items()}
    save_file(state, folder / f"{HEADS_FILE}.tmp", metadata={"format": "pt"})
    os.replace(folder / f"{HEADS_FILE}.tmp", folder / HEADS_FILE)
    config = {**asdict(heads.config), **(extra_config or {})}
    (folder / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(folder / "config.json.tmp", folder / "config.json")


def read_heads_state(folder: Path) -> dict[str, torch.Tensor]:
    """The heads' tensors, reference keys: medusa_lm_head.safetensors, else the reference's
    medusa_lm_head.pt read with weights_only=True (plain tensors, never arbitrary pickles)."""
    path, pt = folder / HEADS_FILE, folder / "medusa_lm_head.pt"
    try:
        if path.is_file():
            with safe_open(path, framework="pt", device="cpu") as st:
                return {k: st.get_tensor(k) for k in st.keys()}
        if pt.is_file():
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # truncation/corruption surfaces with varied exception types
        raise HeadsError(f"cannot read the heads in {folder} (truncated or corrupt?): {e}") \
            from None
    raise HeadsError(f"missing heads file {path}")


def heads_config(raw: dict, state: dict, model_config) -> MedusaConfig:
    """The config of heads files. Published reference heads state only medusa_num_heads and
    medusa_num_layers; the sizes and the form are then read off the tensors: the shared form is
    the one without a projection {i}.{L}.weight."""
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in raw]
    if missing:
        raise HeadsError(f"the heads' config.json lacks {', '.join(missing)}")
    L = raw["medusa_num_layers"]
    projection = state.get(f"0.{L}.weight")
    block = state.get("0.0.linear.weight")
    shared = raw.get("shared_lm_head", projection is None)
    hidden = raw.get("hidden_size") or (block.shape[1] if block is not None else
                                        projection.shape[1] if projection is not None else
                                        model_config.hidden_size)
    vocab = raw.get("vocab_size") or (projection.shape[0] if projection is not None else
                                      model_config.vocab_size)
    kind = raw.get("head_kind", "medusa")
    if kind not in HEAD_KINDS:
        raise HeadsError(f"unknown head_kind {kind!r} in the heads' config.json: "
                         f"one of {', '.join(HEAD_KINDS)}")
    if kind == "hydra" and not shared:
        raise HeadsError("Hydra heads project with the backbone's LM head: their config.json "
                         "must not say shared_lm_head false")
    return MedusaConfig(raw["medusa_num_heads"], L, hidden, vocab, bool(shared), kind)


def load_heads(folder, model) -> MedusaHeads:
    """Heads from a folder (config.json + medusa_lm_head.safetensors or .pt), in this project's
    or the reference's layout, checked against the model."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise HeadsError(f"no config.json in the heads folder {folder}")
    state = read_heads_state(folder)
    cfg = heads_config(json.loads(config_path.read_text()), state, model.config)
    check_heads_fit(cfg, model.config)
    heads = HEAD_KINDS[cfg.head_kind](cfg)
    expected = {k.removeprefix("heads."): v for k, v in heads.state_dict().items()}
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise HeadsError(f"the heads in {folder} lack tensor {missing[0]}")
    for name, t in state.items():
        if name not in expected:
            raise HeadsError(f"unexpected tensor {name} in the heads in {folder}")
        if t.shape != expected[name].shape:
            raise HeadsError(f"tensor {name} has shape {tuple(t.shape)}, "
                             f"the config needs {tuple(expected[name].shape)}")
    heads.heads.load_state_dict(state)
    weight = model.lm_head.weight
    return heads.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)


def save_draft_vocab(folder, ids: torch.Tensor, counts: torch.Tensor) -> None:
    """The training answers' token ids, most frequent first, with their counts
    (heads.token_ranking): a draft vocabulary of any size V' is then the first V' ids."""
    save_file({"ids": ids.contiguous(), "counts": counts.contiguous()},
              Path(folder) / DRAFT_VOCAB_FILE, metadata={"format": "pt"})


def read_draft_vocab(folder) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(token ids most frequent first, their counts), or None when the heads have none."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(path, framework="pt", device="cpu") as st:
            return st.get_tensor("ids"), st.get_tensor("counts")
    except Exception as e:  # truncation/corruption surfaces with varied exception types
        raise HeadsError(f"cannot read {path} (truncated or corrupt?): {e}") from None


def export_v1(heads: MedusaHeads, lm_head: nn.Linear, folder, base_model: str) -> None:
    """Write heads in the reference's "V1" layout that serving engines load: own projections
    (the shared form gets a copy of the LM head per head), medusa_lm_head.safetensors, and a
    config.json with medusa_num_heads, medusa_num_layers and base_model_name_or_path."""
    cfg = heads.config
    if cfg.head_kind != "medusa":
        raise HeadsError(f"{cfg.head_kind} heads have no V1 layout: the serving engines that "
                         "load Medusa heads (vLLM, TensorRT-LLM, TGI) run the paper's kind only")
    own = MedusaHeads(MedusaConfig(cfg.medusa_num_heads, cfg.medusa_num_layers, cfg.hidden_size,
                                   cfg.vocab_size, shared_lm_head=False))
    state = dict(heads.heads.state_dict())
    if cfg.shared_lm_head:
        for i in range(cfg.medusa_num_heads):
            state[f"{i}.{cfg.medusa_num_layers}.weight"] = lm_head.weight.detach().clone()
    own.heads.load_state_dict(state)
    save_heads(own, folder, {"base_model_name_or_path": base_model})


@entry_point
def main(argv=None):
    p = argparse.ArgumentParser(description="Export heads in the reference's V1 layout "
                                "(own projections), for serving engines that load Medusa heads.")
    p.add_argument("heads", type=Path, help="heads folder to export")
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--model", type=Path, default=None,
                   help="the base model folder (default: the default model)")
    p.add_argument("--base-model-name", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="base_model_name_or_path written in config.json (default: %(default)s)")
    args = p.parse_args(argv)
    model = load_model(args.model or ensure_default_model())
    export_v1(load_heads(args.heads, model), model.lm_head, args.out, args.base_model_name)
    print(f"wrote {args.out / HEADS_FILE} and {args.out / 'config.json'}")


if __name__ == "__main__":
    main()
