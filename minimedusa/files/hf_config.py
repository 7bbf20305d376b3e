"""config.json: what an HF Llama-family config says, as this project's LlamaConfig, and back.

Llama, Llama 3.x (RoPE scaling), Qwen2 (q, k, v biases) and Mistral (within its sliding window,
a Llama) read as one LlamaConfig; transformers 4's and 5's spellings of the RoPE settings both.
A switch that would change the computation in a way not implemented here is an error naming it,
never ignored. Left out: other architectures, MLP and output biases, partial rotary, other
RoPE scalings.
"""
import math
from dataclasses import MISSING, asdict, fields

from minimedusa.errors import UserError, json_kind
from minimedusa.model import LlamaConfig


class ConfigError(UserError):
    """A config.json that does not describe a Llama this code can run."""


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
# config.json's values and what each must be where it is given (null: not given); any other is
# a damaged or foreign file, refused in one line that names the key
POSITIVE_INTEGERS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                     "head_dim", "sliding_window")
POSITIVE_NUMBERS = ("rope_theta", "rms_norm_eps")
OBJECTS = ("rope_scaling", "rope_parameters")
MAX_LAYERS = 1024  # the largest Llamas have 126


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def check_values(hf) -> None:
    """Each value config.json gives of the kind HF writes: an object at the top, positive
    integers for sizes, positive numbers, objects for the RoPE settings, token ids."""
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json holds {json_kind(hf)}, not a JSON object")
    kinds = ([(k, "a positive integer", lambda v: is_integer(v) and v > 0)
              for k in POSITIVE_INTEGERS]
             + [(k, "a positive number", is_positive_number) for k in POSITIVE_NUMBERS]
             + [(k, "an object", lambda v: isinstance(v, dict)) for k in OBJECTS]
             + [("model_type", "a name", lambda v: isinstance(v, str)),
                ("architectures", "a list of names",
                 lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v)),
                ("tie_word_embeddings", "true or false", lambda v: isinstance(v, bool)),
                ("bos_token_id", "a token id", lambda v: is_integer(v) and v >= 0),
                ("eos_token_id", "a token id or a list of them", is_token_ids)])
    for key, kind, fits in kinds:
        if hf.get(key) is not None and not fits(hf[key]):
            raise ConfigError(f"config.json's {key} is {str(hf[key])[:40]!r}: it must be {kind}")
    if (hf.get("num_hidden_layers") or 0) > MAX_LAYERS:  # each a module: a typo would fill memory
        raise ConfigError(f"config.json's num_hidden_layers is {hf['num_hidden_layers']}: more "
                          f"than any Llama has (this code takes up to {MAX_LAYERS})")


def is_token_ids(value) -> bool:
    ids = value if isinstance(value, list) else [value]
    return all(is_integer(i) and i >= 0 for i in ids)


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
        if not isinstance(kind, str) or (kind != "default" and kind not in ROPE_SCALINGS):
            raise ConfigError(f"config.json's {key} asks for RoPE scaling {kind!r}, which "
                              f"minimedusa's Llama does not implement (only "
                              f"{', '.join(map(repr, ROPE_SCALINGS))})")
        missing = [k for k in ROPE_SCALINGS.get(kind, ())
                   if not is_positive_number(source.get(k))]
        if missing:
            raise ConfigError(f"config.json's {key} asks for RoPE scaling {kind!r} but lacks "
                              f"{', '.join(missing)} (or it is not a positive number)")
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
    check_values(hf)
    model_type = family(hf)
    check_unsupported(hf, model_type)
    missing = [f.name for f in fields(LlamaConfig)
               if f.default is MISSING and hf.get(f.name) is None]
    if missing:
        raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
    if hf["num_attention_heads"] % hf["num_key_value_heads"]:
        raise ConfigError(f"num_attention_heads={hf['num_attention_heads']} is not a multiple "
                          f"of num_key_value_heads={hf['num_key_value_heads']}")
    check_head_dim(hf)
    known = {f.name for f in fields(LlamaConfig)} - {"rope_theta", "rope_scaling", "qkv_bias"}
    plain = {k: v for k, v in hf.items() if k in known and v is not None}
    return LlamaConfig(**plain | {"max_position_embeddings": context_length(hf, model_type)},
                       qkv_bias=model_type == "qwen2", **rope_settings(hf))


def check_head_dim(hf: dict) -> None:
    """A head's dims, D: head_dim where given, else hidden_size / num_attention_heads, which
    must then divide; even either way (RoPE turns the dims in pairs)."""
    D, C, H = hf.get("head_dim"), hf["hidden_size"], hf["num_attention_heads"]
    if D is None and C % H:
        raise ConfigError(f"hidden_size={C} is not a multiple of num_attention_heads={H}, and "
                          "config.json gives no head_dim")
    D = D if D is not None else C // H
    if D % 2:
        raise ConfigError(f"a head has {D} dims (head_dim, or hidden_size / "
                          "num_attention_heads): rotary embeddings turn them in pairs, so it "
                          "must be even")


def config_to_hf(cfg: LlamaConfig) -> dict:
    """The config.json that HF tools (and config_from_hf) read back: a Qwen2 when the q, k, v
    projections have biases (HF's Llama has no such switch), else a Llama. A Mistral is written
    as the Llama it is within its capped context."""
    model_type = "qwen2" if cfg.qkv_bias else "llama"
    hf = {k: v for k, v in asdict(cfg).items() if k != "qkv_bias"}
    return hf | {"architectures": [FAMILIES[model_type]], "model_type": model_type,
                 "hidden_act": "silu"}
