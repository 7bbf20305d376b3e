"""The rows each kind of heads trains on (train.py's Medusa-1, the tree search's calibration).

A row is one answer position: the stored h_t, the next K tokens (targets) and the tokens a
Hydra head reads. Medusa and Hydra heads train on the rows as the data stores them, shuffled
(StoredRows); a kind that reads more than h_t registers its own rows in ROWS (Hydra++'s draft
layer reads whole answers: experiments/draft_layer_rows.py). Every kind answers the same verbs:
read, held_out_rows, batch, hidden, held_out, and its words for the run's first line.

Shapes: B rows a step, C model dim, K heads.
"""
import torch

from minimedusa.training.loop import batch_rows
from minimedusa.training.medusa1 import Rows, read_rows


class StoredRows:
    """Medusa-1's rows as the data stores them (train, validation), drawn shuffled: each row
    reads its stored h_t."""
    words = ""  # nothing to add to the run's first line

    def __init__(self, train: Rows, val: Rows):
        self.train, self.val = train, val

    @classmethod
    def read(cls, model, data, fingerprint: str, heads, device, world: int) -> "StoredRows":
        """The rows of self-distilled data (the last answers held out)."""
        return cls(*read_rows(data, heads.config.medusa_num_heads, fingerprint,
                              model.config.vocab_size))

    @classmethod
    def held_out_rows(cls, model, data, fingerprint: str, heads, device) -> Rows:
        """The held-out answers' rows alone: what calibration measures on."""
        return read_rows(data, heads.config.medusa_num_heads, fingerprint,
                         model.config.vocab_size)[1]

    def batch(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        """Step `step`'s rows (B,): a fresh order each pass, fixed by the step (a resumed run
        draws the same)."""
        return batch_rows(self.train.targets.shape[0], step, batch_size, seed)

    def hidden(self, heads, index: torch.Tensor, device) -> torch.Tensor:
        """What the heads read at rows `index` (B,): h_t, (B, C) float32."""
        return self.train.hidden[index].to(device, torch.float32)

    def held_out(self, heads, device) -> Rows:
        """The validation rows as the heads read them."""
        return self.val


# head_kind -> its rows (StoredRows's verbs); a kind not here trains on StoredRows
ROWS: dict = {}


def rows_for(heads):
    """The rows class the heads train on."""
    return ROWS.get(heads.config.head_kind, StoredRows)
