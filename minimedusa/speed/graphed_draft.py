"""The heads' draft as CUDA graphs: one graph per tree size, the heads' every depth of it (a
Hydra draft is ~25 kernels a depth), swapped in (fused_draft.fast_draft) while the model's
blocks run in graphs (cuda_graphs.py, which says what a graph needs: fixed shapes, fixed
addresses, no host sync inside).

Shapes: C model dim, N tree nodes.
"""
import torch

from minimedusa.draft import Candidates, TreeDraft, tree_tokens
from minimedusa.speed.cuda_graphs import capture, is_graphed, new_pool


class DraftGraph:
    """One tree's draft as a graph: the hidden state (C,) and root in, its tokens (N,) out."""

    def __init__(self, heads, model, tree, features: torch.Tensor, pool):
        with torch.inference_mode(False):
            self.hidden = torch.zeros_like(features)  # (C,)
            self.root = torch.zeros((), dtype=torch.long, device=features.device)
            self.tokens = torch.zeros(tree.size, dtype=torch.long, device=features.device)

        def run():
            self.tokens.copy_(tree_tokens(heads, model, tree, self.root, self.hidden))
        with torch.inference_mode():
            self.replay = capture(run, features.device, pool)


class GraphedDraft(TreeDraft):
    """TreeDraft whose tokens come from a graph per tree size (the heads' every depth: a
    Hydra draft is ~25 kernels a depth), while the model's blocks are graphed."""

    def __init__(self, heads, trees: dict, rank: dict | None = None):
        super().__init__(heads, trees, rank)
        self.graphs: dict[int, DraftGraph] = {}
        self.pool = new_pool()

    def tree(self, model, n: int, root: int, features: torch.Tensor):
        if not is_graphed(model):  # plug_in.eager_step: the draft eager too
            return super().tree(model, n, root, features)
        if n not in self.graphs:
            self.graphs[n] = DraftGraph(self.heads, model, self.trees[n], features, self.pool)
        graph = self.graphs[n]
        graph.hidden.copy_(features)
        graph.root.fill_(root)
        graph.replay()
        # a copy: the step yields its Candidates (decoding.Step), which a watcher may read
        # after the next step's replay has overwritten the graph's buffer
        return Candidates(self.trees[n], graph.tokens.clone(), self.rank)
