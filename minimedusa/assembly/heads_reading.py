"""--heads and --draft-vocab: the heads a run drafts with, read from a folder (or made
untrained to try the machinery), with the draft vocabulary they rank (on a CPU cut to the
machine's default: speed/defaults.py); float32, as read: the recipe puts them in the model's
format (recipe.decoding_heads).
"""
import json
from pathlib import Path

from minimedusa.errors import UserError
from minimedusa.files.heads_files import (DRAFT_VOCAB_FILE, HeadsError, load_heads,
                                          read_draft_vocab)
from minimedusa.heads import DraftVocabulary, HydraHeads, MedusaHeads
from minimedusa.model import Llama
from minimedusa.speed.defaults import cpu_draft_vocab


def read_heads(spec: str, model: Llama, draft_vocab: int | None = None):
    """A heads folder, or 'untrained:K' / 'untrained-shared:K' / 'untrained-hydra:K': K fresh
    heads (own / shared projection / Hydra's) in the paper's initialisation, for trying the
    machinery without training. With a draft vocabulary of draft_vocab tokens (None: the
    folder's default); float32."""
    heads, config = None, {}
    for prefix in ("untrained:", "untrained-shared:", "untrained-hydra:"):
        if spec.startswith(prefix):
            count = spec.removeprefix(prefix)
            if not count.isdigit() or int(count) < 1:
                raise HeadsError(f"bad heads {spec!r}: use {prefix}K with K >= 1")
            heads = (HydraHeads.for_model(model, int(count)) if prefix == "untrained-hydra:" else
                     MedusaHeads.for_model(model, int(count),
                                           shared_lm_head=prefix == "untrained-shared:"))
            heads.eval().requires_grad_(False)
    if heads is None:
        if not Path(spec).is_dir():
            raise HeadsError(f"heads folder {spec} does not exist")
        heads = load_heads(spec, model)
        config = json.loads((Path(spec) / "config.json").read_text())
    size = (cpu_draft_vocab(config.get("draft_vocab_size", 0), model.embed.weight.device)
            if draft_vocab is None
            else draft_vocab)
    if size:
        heads.vocabulary = draft_vocabulary(spec, heads, model, size)
    return heads.float()


def draft_vocabulary(spec: str, heads, model: Llama, size: int) -> DraftVocabulary:
    """The `size` tokens most frequent in the heads' training answers (weights.save_draft_vocab)."""
    if not heads.config.shared_lm_head:
        raise HeadsError("a draft vocabulary cuts the shared LM head: these heads have their "
                         "own projections (use --draft-vocab 0)")
    counted = read_draft_vocab(spec, model.config.vocab_size) if Path(spec).is_dir() else None
    if counted is None:
        raise HeadsError(f"--draft-vocab: the heads {spec} have no {DRAFT_VOCAB_FILE} (train.py "
                         "writes it); use --draft-vocab 0")
    ids, _ = counted
    if not 0 < size <= model.config.vocab_size:
        raise UserError(f"--draft-vocab must be in 1..{model.config.vocab_size}, got {size}")
    return DraftVocabulary(ids[:size].sort().values, model.lm_head)
