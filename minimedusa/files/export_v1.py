"""Export heads in the Medusa reference's "V1" layout, the one serving engines load.

    python -m minimedusa.files.export_v1 weights/SmolLM2-135M-Instruct-medusa OUT

V1 heads have their own projections: the shared form gets a copy of the LM head per head. Only
the paper's kind of heads exists there (Hydra's heads are refused).
"""
import argparse
from pathlib import Path

import torch.nn as nn

from minimedusa.files.default_model import ensure_default_model
from minimedusa.errors import entry_point
from minimedusa.heads import MedusaConfig, MedusaHeads
from minimedusa.files.heads_files import HEADS_FILE, HeadsError, load_heads, save_heads
from minimedusa.files.weights import load_model


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
    p.prog = "python -m minimedusa.files.export_v1"  # as typed (else argparse names the file)
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
