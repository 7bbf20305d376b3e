"""The heads' files: config.json + medusa_lm_head.safetensors, in the Medusa reference's layout.

The reference's keys ({i}.{j}.linear.weight, {i}.{j}.linear.bias, {i}.{L}.weight), so heads move
between this project and others; the reference's published medusa_lm_head.pt loads too (plain
tensors only, weights_only=True). Loading checks the heads against the model they will run on.
Beside them, draft_vocab.safetensors: the training answers' tokens by frequency. The export to
the layout serving engines load is export_v1.py's.
"""
import json
import pickle
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minimedusa.files.outputs import write_atomically
from minimedusa.errors import UserError, json_kind, unreadable
from minimedusa.heads import HydraHeads, MedusaConfig, MedusaHeads
from minimedusa.model import LlamaConfig

HEADS_FILE = "medusa_lm_head.safetensors"
# config.json's head_kind -> the heads of that kind, made from (their config, the model's):
# experiments/ registers its own (Hydra++'s: experiments/draft_layer.py)
HEAD_KINDS = {"medusa": lambda cfg, model_config: MedusaHeads(cfg),
              "hydra": lambda cfg, model_config: HydraHeads(cfg)}
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # token ids by frequency in the training answers
CALIBRATION = "calibration.json"  # a_k^(i), beside the heads (training/tree_search.py measures it)
MAX_HEADS = 64  # heads, and layers a head: the paper's have 5 and 1


class HeadsError(UserError):
    """Heads that cannot be loaded, or that do not fit the model."""


def check_heads_fit(cfg: MedusaConfig, model_config: LlamaConfig) -> None:
    for field in ("hidden_size", "vocab_size"):
        ours, theirs = getattr(cfg, field), getattr(model_config, field)
        if ours != theirs:
            raise HeadsError(f"the heads' {field} is {ours} but the model's is {theirs}: "
                             "these heads were trained for another model")


def save_heads(heads: MedusaHeads, folder, extra_config: dict | None = None) -> None:
    """The tensors, then config.json, each written beside its name and renamed: a folder with a
    config.json holds whole heads (pipeline.py takes it as training's end)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: t.contiguous() for name, t in files_state(heads).items()}
    write_atomically(folder / HEADS_FILE,
                     lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config = {**asdict(heads.config), **(extra_config or {})}
    write_atomically(folder / "config.json",
                     lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))


def files_state(heads) -> dict[str, torch.Tensor]:
    """The tensors the files hold, by their names there: the heads' under the reference's keys
    (heads.heads), a Hydra++ draft layer's under draft_layer.*; never a draft vocabulary set
    for decoding (a slice of the LM head)."""
    state = dict(heads.heads.state_dict())
    if hasattr(heads, "draft_layer"):  # a layer before the heads (Hydra++'s)
        state.update({f"draft_layer.{k}": t for k, t in heads.draft_layer.state_dict().items()})
    return state


def read_heads_state(folder: Path) -> dict[str, torch.Tensor]:
    """The heads' tensors, reference keys: medusa_lm_head.safetensors, else the reference's
    medusa_lm_head.pt read with weights_only=True (plain tensors, never arbitrary pickles)."""
    path, pt = folder / HEADS_FILE, folder / "medusa_lm_head.pt"
    try:
        if path.is_file():
            with safe_open(path, framework="pt", device="cpu") as st:
                return {k: st.get_tensor(k) for k in st.keys()}
        if pt.is_file():
            state = torch.load(pt, map_location="cpu", weights_only=True)
            if not (isinstance(state, dict) and all(isinstance(k, str) and torch.is_tensor(t)
                                                    for k, t in state.items())):
                raise HeadsError(f"{pt} holds no heads' tensors by name")
            return state
    except pickle.UnpicklingError:
        # note: torch's own message advises weights_only=False, which would run the file's code
        raise HeadsError(f"{pt} holds more than tensors (pickled code or objects), which is "
                         "never run here: keep heads as medusa_lm_head.safetensors") from None
    except HeadsError:
        raise
    except Exception as e:  # truncation/corruption surfaces with varied exception types
        raise HeadsError(unreadable(path if path.is_file() else pt, e)) from None
    raise HeadsError(f"missing heads file {path}")


def heads_config(raw: dict, state: dict, model_config) -> MedusaConfig:
    """The config of heads files. Published reference heads state only medusa_num_heads and
    medusa_num_layers; the sizes and the form are then read off the tensors: the shared form is
    the one without a projection {i}.{L}.weight."""
    check_heads_values(raw)
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if raw.get(k) is None]
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
    if kind in ("hydra", "hydra++") and not shared:
        raise HeadsError("Hydra heads project with the backbone's LM head: their config.json "
                         "must not say shared_lm_head false")
    return MedusaConfig(raw["medusa_num_heads"], L, hidden, vocab, bool(shared), kind)


def check_heads_values(raw) -> None:
    """The heads' config.json: an object whose sizes are positive integers (heads and layers at
    most MAX_HEADS: each is a module), whose switch is true or false and kind a name."""
    if not isinstance(raw, dict):
        raise HeadsError(f"the heads' config.json holds {json_kind(raw)}, not a JSON object")
    for key in ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size",
                "draft_vocab_size"):
        value = raw.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                      and 0 < value and (value <= MAX_HEADS or "size" in key)):
            raise HeadsError(f"the heads' config.json's {key} is {str(value)[:40]!r}: it must be "
                             f"a positive integer{'' if 'size' in key else f' (<= {MAX_HEADS})'}")
    for key, kind, fits in (("shared_lm_head", "true or false", lambda v: isinstance(v, bool)),
                            ("head_kind", "a name", lambda v: isinstance(v, str))):
        if raw.get(key) is not None and not fits(raw[key]):
            raise HeadsError(f"the heads' config.json's {key} is {str(raw[key])[:40]!r}: it "
                             f"must be {kind}")


def load_heads(folder, model) -> MedusaHeads:
    """Heads from a folder (config.json + medusa_lm_head.safetensors or .pt), in this project's
    or the reference's layout, checked against the model."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise HeadsError(f"no config.json in the heads folder {folder}")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise HeadsError(f"{config_path} is not valid JSON: {e}") from None
    state = read_heads_state(folder)
    cfg = heads_config(raw, state, model.config)
    check_heads_fit(cfg, model.config)
    heads = HEAD_KINDS[cfg.head_kind](cfg, model.config)
    expected = files_state(heads)
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise HeadsError(f"the heads in {folder} lack tensor {missing[0]}")
    for name, t in state.items():
        if name not in expected:
            raise HeadsError(f"unexpected tensor {name} in the heads in {folder}")
        if t.shape != expected[name].shape:
            raise HeadsError(f"tensor {name} has shape {tuple(t.shape)}, "
                             f"the config needs {tuple(expected[name].shape)}")
        if not (t.is_floating_point() and torch.isfinite(t).all()):
            raise HeadsError(f"tensor {name} of the heads in {folder} is not finite floating "
                             "point (NaN, inf, or integers): a diverged training run?")
    heads.heads.load_state_dict({k: t for k, t in state.items()
                                 if not k.startswith("draft_layer.")})
    if hasattr(heads, "draft_layer"):
        heads.draft_layer.load_state_dict({k.removeprefix("draft_layer."): t
                                           for k, t in state.items()
                                           if k.startswith("draft_layer.")})
    weight = model.lm_head.weight
    return heads.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)


def save_draft_vocab(folder, ids: torch.Tensor, counts: torch.Tensor) -> None:
    """The training answers' token ids, most frequent first, with their counts
    (heads.token_ranking): a draft vocabulary of any size V' is then the first V' ids."""
    tensors = {"ids": ids.contiguous(), "counts": counts.contiguous()}
    write_atomically(Path(folder) / DRAFT_VOCAB_FILE,
                     lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def read_draft_vocab(folder, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(token ids most frequent first, their counts), or None when the heads have none; checked
    against a model of vocab_size tokens: distinct integer ids below it, a count each."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(path, framework="pt", device="cpu") as st:
            ids, counts = st.get_tensor("ids"), st.get_tensor("counts")
    except Exception as e:  # truncation/corruption surfaces with varied exception types
        raise HeadsError(unreadable(path, e)) from None
    fits = (ids.dim() == 1 and len(ids) > 0 and not ids.is_floating_point()
            and ids.dtype != torch.bool and counts.shape == ids.shape
            and 0 <= ids.min().item() and ids.max().item() < vocab_size
            and len(ids.unique()) == len(ids))
    if not fits:
        raise HeadsError(f"{path} is not a draft vocabulary for this model: it must hold 'ids', "
                         f"distinct integer token ids in 0..{vocab_size - 1} most frequent "
                         "first, and their 'counts' (train.py writes it): delete it to decode "
                         "without one")
    return ids.long(), counts


def read_calibration(heads_dir: Path) -> torch.Tensor | None:
    """The heads' a_k^(i) (K, R) from their calibration.json, or None if not calibrated: a
    JSON object whose "accuracy" holds K rows of R probabilities each."""
    path = Path(heads_dir) / CALIBRATION
    if not path.is_file():
        return None
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))["accuracy"]
        accuracy = torch.tensor(rows, dtype=torch.float64)
    except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError, RecursionError):
        accuracy = None  # not JSON, not an object, no "accuracy", ragged, strings
    if (accuracy is None or accuracy.dim() != 2 or accuracy.numel() == 0
            or not ((0 <= accuracy) & (accuracy <= 1)).all()):  # NaN fails this too
        raise HeadsError(f"{path} is not a calibration: a JSON object whose \"accuracy\" is a "
                         "list of rows (one a head), each of probabilities in [0, 1] of equal "
                         "length; delete it, or measure again: python -m "
                         "minimedusa.training.tree_search")
    return accuracy.float()
