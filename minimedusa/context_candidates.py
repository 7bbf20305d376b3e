"""Context candidates: a branch of the step's tree read from the sequence itself (prompt lookup
decoding, Saxena 2023; the retrieval half of SAM-Decoding), no heads and no training.

Chat answers copy: from the question (names, code, phrases to extract) and from themselves
(a repeated pattern, a list's format). When the last n tokens of the sequence (prompt and
answer so far, the step's root included) occurred before, the tokens that followed them there
are a guess at what follows now: the chain. It is merged into the heads' tree for the step
(with_chain): where its tokens are already the heads' guesses it follows their nodes, the rest
hangs below as new nodes, and the heads' least probable nodes make room, so the step verifies
no more nodes than its budget. Verification is unchanged, so decoding stays lossless.

On the default model's answers to MT-Bench questions the chain alone accepts about as many
tokens a step as the shipped Hydra heads, and merged with their trees more than either
(weights/HISTORY.md); chains of 3 to 6 tokens were tried, 5 was best, by a little.

The step's budget (budget.Budget) sizes each step by how long a suffix its chain matched (its
group): the longer the match, the more often the chain is right (a 3-token match's first token
far more often than a 1-token match's), so a step whose chain matched 3 tokens gains from a
bigger tree, one with a 1-token match or none does not. A 1-token match proposes no chain
(MIN_MATCH): its chain alone filled a 1-node step, guessing worse than the heads' top guess.
Left out: several chains a step (the most recent match only), a suffix automaton over a corpus.

Shapes: N tree nodes.
"""
import functools

import torch

from minimedusa.draft import Candidates
from minimedusa.tree import MedusaTree, build_tree


CHAIN = 5  # tokens a chain proposes
MIN_MATCH = 2  # the shortest suffix whose match proposes a chain


class ContextIndex:
    """The sequence so far, and for every n-gram (min_ngram <= n <= max_ngram) where it ended
    the last two times it occurred: the last is usually the sequence's own end, the one before
    is the match."""

    def __init__(self, tokens: list[int], max_ngram: int = 3, length: int = CHAIN,
                 min_ngram: int = MIN_MATCH):
        self.max_ngram, self.length = max_ngram, length  # longest match sought, chain length
        self.min_ngram = min_ngram  # shortest match sought
        self.tokens: list[int] = []
        self.ends: dict[tuple, tuple[int, int | None]] = {}  # n-gram -> (last end, the one before)
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        for token in new:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n in range(self.min_ngram, min(self.max_ngram, len(self.tokens)) + 1):
                gram = tuple(self.tokens[-n:])
                self.ends[gram] = (end, self.ends.get(gram, (None, None))[0])

    def match(self) -> tuple[int, list[int]]:
        """(the length of the longest suffix (max_ngram tokens down to min_ngram) that occurred
        before, 0 if none did; the chain: the `length` tokens that followed it where it last
        occurred before, [] if none).

        >>> ContextIndex([5, 6, 7, 8, 5, 6]).match()   # [5, 6] occurred before, then 7, 8, ...
        (2, [7, 8, 5, 6, 7])
        >>> ContextIndex([1, 2, 9, 9, 9]).match()    # a copy that reaches the end copies itself
        (2, [9, 9, 9, 9, 9])
        >>> ContextIndex([5, 6, 7, 6]).match()    # [6] alone: too short a match
        (0, [])
        """
        for n in range(min(self.max_ngram, len(self.tokens)), self.min_ngram - 1, -1):
            _, before = self.ends.get(tuple(self.tokens[-n:]), (None, None))
            if before is not None:
                return n, copied(self.tokens, before + 1, self.length)
        return 0, []


def copied(tokens: list[int], start: int, length: int) -> list[int]:
    """`length` tokens copied from tokens[start:] on, past the end going on with the copy
    itself: a repeat of period len(tokens) - start."""
    chain = []
    for j in range(start, start + length):
        chain.append(tokens[j] if j < len(tokens) else chain[j - len(tokens)])
    return chain


@functools.lru_cache(maxsize=1024)
def merged_tree(paths: tuple[tuple, ...], device: torch.device) -> MedusaTree:
    """build_tree's tree of these node paths, built once: a step's merged tree takes one of a
    few hundred shapes (where the chain leaves the heads' nodes, how long it is), and building
    one in Python costs a few percent of a CPU step. Trees are never changed once built, so
    steps may share one."""
    return build_tree(paths, device=device)


def with_chain(tree: MedusaTree, tokens: torch.Tensor, rank: dict, size: int,
               chain: list[int]) -> tuple[MedusaTree, torch.Tensor, dict]:
    """The step's tree (size nodes, root excluded) with the chain hung from its root: (the
    merged tree, its tokens (N,), each node path's rank for the budget, budget.Budget.record).

    tree, tokens: the heads' tree of `size` nodes and its drafted tokens; rank: each of its
    node paths' place among the grown nodes (budget.nested_trees). The chain follows the
    heads' nodes while it agrees with them; its other tokens become new nodes, each taking the
    place of the heads' least probable node. The returned rank is each node's place in the
    merged tree's order, the chain's nodes first (by depth), then the heads' (by their rank):
    the first m nodes of it are the tree that a step of m nodes would have merged (its chain
    cut to m tokens), which is what the budget counts a smaller tree's acceptance by.
    note: reads the drafted tokens on the host, a second sync of the step (free on a CPU).
    """
    token_of = dict(zip(tree.nodes, tokens.tolist()))  # node path -> token
    path, on_chain, new = (), [], False  # the chain's nodes by depth; new: off the heads'
    for token in chain[:size]:
        child = None if new else next((p for p in tree.nodes if p[:-1] == path and
                                       len(p) == len(path) + 1 and token_of[p] == token), None)
        if child is None:  # a new node: the next free rank below its parent
            ranks = [p[-1] for p in tree.nodes if p and p[:-1] == path]
            child, new = path + (1 + max(ranks, default=-1),), True
            token_of[child] = token
        on_chain.append(child)
        path = child
    heads = sorted((p for p in tree.nodes[1:] if p not in on_chain), key=rank.get)
    order = (on_chain + heads)[:size]
    merged = merged_tree(tuple(sorted(order)), tokens.device)
    merged_tokens = torch.tensor([token_of[p] for p in merged.nodes], device=tokens.device)
    return merged, merged_tokens, {p: i + 1 for i, p in enumerate(order)}


def chain_alone(root: int, chain: list[int], device) -> tuple[MedusaTree, torch.Tensor, dict]:
    """with_chain's result where the chain fills the step (as many tokens as the tree has
    nodes: the heads' nodes get no room): the chain alone, a path from the root, its tokens
    (N,) and ranks, so that the heads need not draft at all (a draft is a few percent of a CPU
    step). The same tokens as with_chain keeps, tested."""
    paths = tuple((0,) * depth for depth in range(1, len(chain) + 1))
    tree = merged_tree(paths, torch.device(device))
    return tree, torch.tensor([root, *chain], device=device), {p: len(p) for p in paths}


def on_nodes(values: torch.Tensor, tree: MedusaTree, merged: MedusaTree) -> torch.Tensor:
    """A value a node of `tree` (N,), laid out on the nodes of the tree merged from it (a node
    the chain added: NaN)."""
    index = {path: i for i, path in enumerate(tree.nodes)}
    return torch.tensor([values[index[p]].item() if p in index else float("nan")
                         for p in merged.nodes])


class ContextDraft:
    """Another draft (draft.py's verbs) with context candidates: each step's chain, read from
    the sequence so far (ContextIndex), takes the least probable nodes' places in the draft's
    tree (with_chain), all of them where it has as many tokens (chain_alone: no draft at all);
    how long a suffix it matched is the step's group for the Budget."""

    def __init__(self, draft):
        self.draft, self.index, self.chain = draft, None, []

    def start(self, prompt_ids: list[int], cache) -> None:
        self.index = ContextIndex(prompt_ids)
        self.draft.start(prompt_ids, cache)

    def read(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft.read(hidden)

    def match(self, root: int) -> int:
        """The step's group; its chain kept for tree()."""
        self.index.extend([root])
        group, self.chain = self.index.match()
        return group

    def tree(self, model, n: int, root: int, features: torch.Tensor):
        if len(self.chain) >= n:  # no draft: nothing drawn, the chain's tokens point masses
            tree, tokens, rank = chain_alone(root, self.chain[:n], features.device)
            return Candidates(tree, tokens, rank, context=tree.nodes[1:])
        drafted = self.draft.tree(model, n, root, features)
        if not self.chain:
            return drafted
        tree, tokens, rank = with_chain(drafted.tree, drafted.tokens, drafted.rank, n, self.chain)
        chain = tuple(p for p in tree.nodes[1:] if rank[p] <= len(self.chain))  # first in rank
        q = None if drafted.q is None else lambda: on_nodes(drafted.q(), drafted.tree, tree)
        # what the heads' nodes were drawn from: the proposal names them by their paths
        return Candidates(tree, tokens, rank, drafted.proposal, q, chain, drafted.drafter)

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)
        self.draft.extend(tokens)
