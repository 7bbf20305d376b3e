"""Weights kept in their format: a quantized model's blocks, rounded and packed once, written to
the cache folder by the first run and read back by later ones, which then start in seconds
(rounding a 1B model's blocks takes several: grids.py, group_kernel.pack_int4).

A kept file holds every block's state as the format left it: each quantized layer's tensors
(its buffers, parameters and plain tensor attributes: int4's scales and minimums are kept out
of .to()) with its class and sizes, and the norms. It is read under a key of all it depends on:
the model's files as stored (each one's name, size and modification time: a changed file is
another key, never a stale read), the format and its activations' dtype, this CPU and which
kernel multiplies, the sources of the rounding, packing and kernels, torch's version. One file
per model folder and format: a new key replaces the old one. A damaged file is read as none.
Left out: the embedding, the final norm and the LM head, read from the model's files each run
(no rounding there but the LM head's grid check).

Shapes: N output features, K input features.
"""
import hashlib
import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from minimedusa.speed import c_kernels, group_kernel
from minimedusa.speed.cache_folder import cache_folder
from minimedusa.speed.machine import cpu_features
from minimedusa.speed.quantized import (Int4A8KernelLinear, Int4A16KernelLinear, Int4KernelLinear,
                                        Int4Linear, Int8Linear)
from minimedusa.speed.format_layers import LARGE, block_weights

LAYERS = {cls.__name__: cls for cls in (Int8Linear, Int4Linear, Int4KernelLinear,
                                        Int4A8KernelLinear, Int4A16KernelLinear)}
# the code whose output a kept file holds: a change there is another key
SOURCES = [Path(__file__).parent / name for name in ("grids.py", "quantized.py",
                                                      "group_kernel.py")]


def kept_file(folder: Path, fmt) -> Path:
    """Where a model folder's blocks in format `fmt` are kept: named by the folder (and a
    hash of its full path, so two folders of one name do not share a file)."""
    folder = Path(folder).resolve()
    tag = hashlib.sha256(str(folder).encode()).hexdigest()[:8]
    return cache_folder() / "weights" / f"{folder.name}-{tag}-{fmt.name}.safetensors"


def weights_key(files: list[Path], fmt) -> str:
    """16 hex digits of everything the kept blocks depend on (the module's docstring); files:
    the model's as stored (its config.json and safetensors files)."""
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    parts = [json.dumps(stats), fmt.name, str(fmt.activation_dtype()),
             cpu_features(), str(group_kernel.kernel_problem() is None), torch.__version__,
             c_kernels.sources_digest(), *(source.read_text() for source in SOURCES)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def layer_tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A quantized layer's tensors, by kind: "buffer.packed", "parameter.bias", "attr.scales"."""
    tensors = {f"buffer.{n}": t for n, t in layer._buffers.items() if t is not None}
    tensors |= {f"parameter.{n}": p.data for n, p in layer._parameters.items() if p is not None}
    tensors |= {f"attr.{n}": v for n, v in vars(layer).items() if isinstance(v, torch.Tensor)}
    return tensors


def rebuilt_layer(kind: str, sizes: list[int], tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The layer layer_tensors took apart, made again from its tensors: no rounding, no
    packing (its __init__, which does both, is not run)."""
    layer = LAYERS[kind].__new__(LAYERS[kind])
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = sizes
    layer.bias = None  # unless kept
    for name, t in tensors.items():
        where, attr = name.split(".", 1)
        if where == "buffer":
            layer.register_buffer(attr, t)
        elif where == "parameter":
            setattr(layer, attr, nn.Parameter(t, requires_grad=False))
        else:
            setattr(layer, attr, t)
    return layer


def worth_keeping(config, fmt) -> bool:
    """Whether a model's rounded blocks are kept: a format that rounds (the others read as
    stored), and a model of real size (format_layers.LARGE: below, rounding again costs about
    what reading them back would)."""
    return fmt.rounds and block_weights(config) >= LARGE


def quantized_layers(block: nn.Module) -> dict[str, nn.Module]:
    return {path: layer for path, layer in block.named_modules()
            if type(layer).__name__ in LAYERS}


def kept_state(model) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """What a kept file holds of the model's blocks, formatted: (every tensor by name, each
    quantized layer's class and sizes by its path)."""
    state, layers = {}, {}
    for i, block in enumerate(model.layers):
        quantized = quantized_layers(block)
        for path, layer in quantized.items():
            layers[f"{i}.{path}"] = [type(layer).__name__, layer.in_features, layer.out_features]
            state |= {f"{i}.{path}.{n}": t for n, t in layer_tensors(layer).items()}
        state |= {f"{i}.{name}": t for name, t in block.state_dict().items()
                  if name.rsplit(".", 1)[0] not in quantized}
    return {k: t.contiguous() for k, t in state.items()}, layers


class KeptBlocksError(Exception):
    """A kept file that broke while it was read: the model is read and rounded instead."""


class KeptBlocks:
    """A kept file of a model's blocks, checked against the model's files: fill(i, block) makes
    block i (built on the meta device) as the format left it."""

    def __init__(self, path: Path, layers: dict[str, list]):
        self.path, self.layers = path, layers

    def fill(self, i: int, block: nn.Module) -> None:
        try:
            # clone: a tensor as get_tensor gives it keeps a map of the whole file while it
            # lives, and every block's did (7.2 GB of address space for a 1.1B model in int4)
            with safe_open(self.path, framework="pt", device="cpu") as kept:
                tensors = {n.removeprefix(f"{i}."): kept.get_tensor(n).clone()
                           for n in kept.keys() if n.startswith(f"{i}.")}
        except Exception as e:  # safetensors' errors have varied types
            raise KeptBlocksError(f"{self.path}: {e}") from None
        paths = [path.split(".", 1)[1] for path in self.layers if path.startswith(f"{i}.")]
        for path in paths:
            kind, *sizes = self.layers[f"{i}.{path}"]
            own = {n.removeprefix(path + "."): t for n, t in tensors.items()
                   if n.startswith(path + ".")}
            parent, _, name = path.rpartition(".")
            setattr(block.get_submodule(parent), name, rebuilt_layer(kind, sizes, own))
        rest = {n: t for n, t in tensors.items() if n.rsplit(".", 2)[0] not in paths}  # norms
        block.load_state_dict(rest, strict=False, assign=True)
        if any(t.is_meta for t in block.state_dict().values()):
            raise KeptBlocksError(f"{self.path}: block {i} is not whole")


def read_kept(folder: Path, fmt, key: str) -> KeptBlocks | None:
    """The kept blocks of this model and format, if a file holds them under today's key
    (weights_key); None (the model is read and rounded) where there is none, it is another
    key's, or damaged."""
    path = kept_file(folder, fmt)
    if not fmt.rounds or not path.is_file():
        return None
    try:
        with safe_open(path, framework="pt", device="cpu") as kept:
            metadata = kept.metadata() or {}
        if metadata.get("key") != key:
            return None
        return KeptBlocks(path, json.loads(metadata["layers"]))
    except Exception:  # a damaged file: safetensors' errors have varied types
        return None
