"""The draft (paper section 2): each step's candidate tree and its tokens, guessed by the heads
from the hidden state at the last accepted position, before the one forward that verifies them.

The decoding loop (decoding.medusa_decode) asks a draft five things, in the order a run uses
them: start(prompt ids, cache) before the prefill; read(hidden (a, C)) after every forward, what
the heads will read (here the last position's hidden state); match(root), the Budget's group
for the step (how long a suffix a context chain matched: 0 here, context_candidates.py);
tree(model, n, root, features, rank), the step's Candidates: its tree of n nodes, its tokens
(n + 1,), each node path's rank, and what drawn candidates were drawn from, which the loop
hands the acceptance with them; extend(tokens), the step's accepted candidates.

TreeDraft is the paper's: a fixed tree every step (budget.fixed), or one of nested trees of the
sizes the Budget chooses among (budget.nested_trees). Others: the confidence-ranked tree
(ranked_tree.RankedDraft), context candidates around any draft (context_candidates.ContextDraft).

Shapes: C model dim, K heads, V vocab (V' the heads' draft vocabulary), N tree nodes.
"""
from dataclasses import dataclass
from typing import Protocol

import torch

from minimedusa.heads import DraftVocabulary, MedusaHeads, as_features, drafting_lm_head, token_ids
from minimedusa.hydra import HydraHeads, hydra_candidates
from minimedusa.tree import MedusaTree


@dataclass
class Candidates:
    """A step's draft, handed whole from the draft to the acceptance: the tree, its tokens (N,)
    root first, each node path's rank (what the Budget records a step by), and for candidates
    drawn from the heads what they were drawn from (speculative_sampling.Proposal; None: every
    candidate is a point mass, as the heads' top-k are)."""
    tree: MedusaTree
    tokens: torch.Tensor
    rank: dict
    proposal: object = None


class Draft(Protocol):
    """The five verbs decoding.medusa_decode asks of a draft (the module's docstring says when);
    TreeDraft below is the paper's."""

    def start(self, prompt_ids: list[int], cache) -> None: ...

    def read(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def match(self, root: int) -> int: ...

    def tree(self, model, n: int, root: int, features: torch.Tensor,
             rank: dict) -> Candidates: ...

    def extend(self, tokens: list[int]) -> None: ...


def best_guesses(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The paper's guesses: the k largest logits' columns, best first, (..., V) -> (..., k)."""
    return logits.topk(k, dim=-1).indices


def candidates(root: torch.Tensor, head_logits: torch.Tensor, tree: MedusaTree,
               vocabulary: DraftVocabulary | None = None, pick=best_guesses) -> torch.Tensor:
    """The tree's tokens: (N,) int64, from the root token () and the heads' logits (K, V).

    The heads' top-k are laid out flat as [root, head 1's top-k, head 2's top-k, ...], and
    tree.token_index says where each node's token sits in that list (tree.py). `vocabulary`:
    the draft vocabulary whose columns the heads score, if any (heads.DraftVocabulary);
    `pick`: how a head's k guesses are chosen from its logits (best_guesses;
    speculative_sampling.py draws them)."""
    top = token_ids(vocabulary, pick(head_logits[:tree.num_heads], tree.top_k))
    flat = torch.cat([root.reshape(1), top.reshape(-1)])  # (1 + D * top_k,)
    return flat[tree.token_index]


@torch.inference_mode()
def guess(heads: MedusaHeads, model, hidden: torch.Tensor) -> torch.Tensor:
    """The heads' logits (K, V) at one position, from its hidden state (C,) (V': over the
    heads' draft vocabulary, when they have one)."""
    return heads(hidden, drafting_lm_head(heads.vocabulary, model.lm_head))


def tree_tokens(heads: MedusaHeads | HydraHeads, model, tree: MedusaTree,
                root: int | torch.Tensor, hidden: torch.Tensor, pick=best_guesses) -> torch.Tensor:
    """The tree's candidate tokens (N,), root first, guessed at the position whose hidden state
    (or what the heads read there: a draft's read) is hidden (C,). Medusa heads guess every
    depth at once from h_t alone; Hydra heads read the draft's own tokens, so they guess depth
    by depth (hydra.py). root: its token id, or a 0-d tensor of it on hidden's device (a CUDA
    graph's input, speed/cuda_graphs.py)."""
    root = torch.as_tensor(root, device=hidden.device)
    if isinstance(heads, HydraHeads):
        return hydra_candidates(heads, model, hidden, root, tree, pick)
    return candidates(root, guess(heads, model, hidden), tree, heads.vocabulary, pick)


class TreeDraft:
    """The heads' guesses on a tree of each size the budget may ask for: trees[n]."""

    def __init__(self, heads: MedusaHeads | HydraHeads, trees: dict[int, MedusaTree]):
        self.heads, self.trees = heads, trees

    def start(self, prompt_ids: list[int], cache) -> None:
        pass  # nothing to set up: the heads read one hidden state, the last

    def read(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the heads read after a forward that kept hidden (a, C): the last position's."""
        return as_features(self.heads, hidden[-1])

    def match(self, root: int) -> int:
        return 0  # no context chain: every step in the budget's one group

    def tree(self, model, n: int, root: int, features: torch.Tensor, rank: dict) -> Candidates:
        """trees[n], its tokens (n + 1,), root first, each node path's rank."""
        tree = self.trees[n]
        return Candidates(tree, tree_tokens(self.heads, model, tree, root, features), rank)

    def extend(self, tokens: list[int]) -> None:
        pass  # the accepted tokens change nothing the heads keep
