"""A Llama's GGUF file (the default model's Q4_1 one) read into the files of an HF folder:
config.json from its metadata, every tensor dequantized to float32 under its HF name (llama.cpp's
Q/K row permutation undone), and SmolLM2's tokenizer built from its vocabulary and merges
(tokenizer.json, tokenizer_config.json with the chat template). The `gguf` package, the GGUF
format's reference reader, reads the file; this module only maps it. Left out: any other GGUF
architecture or tokenizer (GGUFError says which). files/default_model.py fetches the file and
writes the folder.
"""
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from minimedusa.errors import UserError

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

class GGUFError(UserError):
    """The GGUF file is not one this module converts (another architecture or tokenizer)."""


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
        raise GGUFError(f"GGUF file lacks metadata {key}")
    return field.contents()


def hf_config(reader) -> dict:
    arch = gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF architecture is {arch!r}, only 'llama' is converted")
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
            raise GGUFError(f"GGUF tensor {t.name} has no HF counterpart")
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
        raise GGUFError(f"GGUF tokenizer is {pre!r}; only SmolLM2's ('smollm') is built")
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


def write_converted(reader_class, gguf_path: Path, tmp: Path) -> None:
    """The HF folder's files from the GGUF, into tmp."""
    reader = reader_class(gguf_path)
    cfg = hf_config(reader)
    save_file(hf_tensors(reader, cfg), tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer_json, tokenizer_config = tokenizer_files(reader)
    (tmp / "tokenizer.json").write_text(tokenizer_json)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


