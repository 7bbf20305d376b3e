"""Hydra++'s draft layer in training: whole answers through the layer (draft_layer.py), and
how it plugs into train.py (training/head_rows.ROWS, training/medusa1.FRESH_HEADS and
FROM_TRAINED: register, which experiments.register_training calls where training starts).

Training runs the layer over whole answers: the backbone's states at the prompt (computed once,
prompt_states) followed by those stored with the answer, which the layer reads at the same
positions as in decoding. A step draws its rows from ANSWERS_PER_BATCH answers: the heads then
learn on rows about as varied as Hydra's shuffled ones (measured: a step of the 256 rows of
2 whole answers reached top-1 0.33 at step 500 where shuffled rows reached 0.43), while the
layer reads 8 answers, ~1,500 positions, a step.

Shapes: B answers, T positions, C model dim, K heads, M answer positions (rows).
"""
from dataclasses import dataclass

import torch

from minimedusa.errors import UserError
from minimedusa.experiments.draft_layer import DraftLayer, HydraPlusPlusHeads, with_draft_layer
from minimedusa.heads import HydraHeads
from minimedusa.model import causal_mask
from minimedusa.training import head_rows, medusa1
from minimedusa.training.medusa1 import Rows, read_answers, rows_of, split_validation
from minimedusa.training.rehidden import teacher_forced_hidden
from minimedusa.training.loop import batch_rows
from minimedusa.training.progress import say


def prompt_states(model, prompts: list[torch.Tensor], batch_size: int = 64) -> list[torch.Tensor]:
    """The backbone's final hidden states at each prompt's positions but the last, (p - 1, C)
    each (bf16, as the stored answer states): the last position's state is the answer's row 0,
    stored with the data already. These are the rows of p[1:] read as an answer to p[:1]
    (rehidden.teacher_forced_hidden: the state at the token before each), a batch of prompts
    one forward."""
    states = []
    for a in range(0, len(prompts), batch_size):
        pairs = [(p[:1], p[1:]) for p in prompts[a:a + batch_size]]
        states += [h.to(torch.bfloat16) for h in teacher_forced_hidden(model, pairs)]
    return states


# answers a training step draws its rows from (each read whole by the layer)
ANSWERS_PER_BATCH = 8


@dataclass
class AnswerRows:
    """Medusa-1's rows (training.Rows, answer after answer), with what the draft layer reads
    before each answer: the prompt's states. Answer j's rows are rows[offsets[j]:offsets[j+1]]."""
    rows: Rows
    prompts: list[torch.Tensor]  # (p_j - 1, C) bf16 each
    offsets: torch.Tensor  # (answers + 1,) int64

    def __len__(self) -> int:
        return len(self.prompts)

    def row_index(self, answers: torch.Tensor) -> torch.Tensor:
        """The rows (M,) of the given answers (increasing), answer after answer."""
        return torch.cat([torch.arange(self.offsets[j], self.offsets[j + 1])
                          for j in answers.tolist()])

    def sample_rows(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        """Step `step`'s rows (B,), increasing: batch_size drawn at random from the rows of
        ANSWERS_PER_BATCH answers (answers in a fresh order each pass over them, as
        training.batch_rows orders rows); fixed by the step, so a resumed run draws the same."""
        answers = batch_rows(len(self), step, min(ANSWERS_PER_BATCH, len(self)), seed).sort()
        rows = self.row_index(answers.values)
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return rows[torch.randperm(len(rows), generator=g)[:batch_size].sort().values]

    def features_at(self, layer: DraftLayer, index: torch.Tensor, device) -> torch.Tensor:
        """The layer's output f at rows `index` (M,) (increasing), (M, C): it reads each of the
        rows' answers whole."""
        answers = torch.searchsorted(self.offsets, index, right=True) - 1  # (M,)
        answers = answers.unique()  # sorted
        features = layer_features(layer, self, answers, device)  # every row of those answers
        return features[torch.searchsorted(self.row_index(answers).to(features.device),
                                           index.to(features.device))]


def answer_rows(model, answers: list[tuple], num_heads: int) -> AnswerRows:
    """answers (prompt ids, answer ids, hidden) as rows with their prompts' states."""
    offsets = torch.tensor([0] + [len(a) for _, a, _ in answers]).cumsum(0)
    return AnswerRows(rows_of(answers, num_heads), prompt_states(model, [p for p, _, _ in answers]),
                     offsets)


def layer_features(layer: DraftLayer, data: AnswerRows, answers: torch.Tensor,
                   device) -> torch.Tensor:
    """f at every row of the given answers (M, C), in the layer's dtype: each answer's sequence
    (its prompt's states, then its rows' stored states) through the layer, padded at the end
    (causal: padding is never read)."""
    seqs = [torch.cat([data.prompts[j], data.rows.hidden[data.offsets[j]:data.offsets[j + 1]]])
            for j in answers.tolist()]
    B, T = len(seqs), max(len(s) for s in seqs)
    hidden = torch.zeros(B, T, seqs[0].shape[1], dtype=layer.block.attn_norm.weight.dtype)
    for b, s in enumerate(seqs):
        hidden[b, :len(s)] = s
    positions = torch.arange(T, device=device).expand(B, T)
    out = layer(hidden.to(device), positions, causal_mask(0, T, device).expand(B, T, T))
    return torch.cat([out[b, len(data.prompts[j]):len(s)]
                      for b, (j, s) in enumerate(zip(answers.tolist(), seqs))])


@torch.no_grad()
def featured_rows(heads: HydraPlusPlusHeads, data: AnswerRows, device,
                  answers_per_batch: int = 16) -> Rows:
    """The rows with f_t in place of h_t: what evaluation and calibration read (then the heads
    are Hydra heads)."""
    features = [layer_features(heads.draft_layer, data, torch.arange(a, min(a + answers_per_batch,
                                                                            len(data))), device)
                .cpu() for a in range(0, len(data), answers_per_batch)]
    return Rows(torch.cat(features), data.rows.targets, data.rows.tokens)


class WholeAnswers:
    """Hydra++'s rows (training/head_rows.py's verbs): a step's rows drawn from
    ANSWERS_PER_BATCH whole answers, which the draft layer reads whole (with their prompts'
    states); validated on the held-out answers' f_t."""
    words = f", {ANSWERS_PER_BATCH} whole answers a batch"

    def __init__(self, train: AnswerRows, val: AnswerRows):
        self.answers, self.train, self.val = (train, val), train.rows, val.rows

    @classmethod
    def read(cls, model, data, fingerprint: str, heads, device, world: int) -> "WholeAnswers":
        if world > 1:
            raise UserError("--kind hydra++ trains in one process (its draft layer runs outside "
                            "DistributedDataParallel's forward): run train.py without torchrun")
        say("computing the prompts' hidden states for the draft layer")
        parts = split_validation(read_answers(data, fingerprint, model.config.vocab_size))
        return cls(*(answer_rows(model, part, heads.config.medusa_num_heads)
                     for part in parts))

    @classmethod
    def held_out_rows(cls, model, data, fingerprint: str, heads, device) -> Rows:
        _, val = split_validation(read_answers(data, fingerprint, model.config.vocab_size))
        return featured_rows(heads, answer_rows(model, val, heads.config.medusa_num_heads),
                             device)

    def batch(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        return self.answers[0].sample_rows(step, batch_size, seed)

    def hidden(self, heads, index: torch.Tensor, device) -> torch.Tensor:
        return self.answers[0].features_at(heads.draft_layer, index, device)

    def held_out(self, heads, device) -> Rows:
        return featured_rows(heads, self.answers[1], device)


def register() -> None:
    """Hydra++'s training in train.py's tables (experiments.register_training calls it)."""
    head_rows.ROWS["hydra++"] = WholeAnswers
    medusa1.FRESH_HEADS["hydra++"] = lambda model, a: HydraPlusPlusHeads.for_model(
        model, a.heads, a.layers)
    # trained Hydra heads start Hydra++ behind a fresh draft layer (others as they are)
    medusa1.FROM_TRAINED["hydra++"] = lambda heads, model: (
        with_draft_layer(heads, model) if type(heads) is HydraHeads else heads)
