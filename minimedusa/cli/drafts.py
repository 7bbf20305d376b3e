"""--tree, read into what decoding.medusa_decode drafts with: the draft (the heads' guesses on a
tree: draft.TreeDraft, fused where speed fuses it; or draft.RankedDraft), and the budget
that picks each step's tree size (budget.fixed for one tree, else the Budget of trees.py);
read through a Hydra++ draft layer for such heads, with context candidates where asked.
"""
from minimedusa.budget import FixedSize, fixed
from minimedusa.cli.trees import decoding_budget, decoding_tree, ranked_size
from minimedusa.context_candidates import ContextDraft
from minimedusa.draft import RankedDraft, TreeDraft
from minimedusa.experiments.draft_layer import HydraPlusPlusHeads, PlusPlusDraft
from minimedusa.model import Llama
from minimedusa.speculative_sampling import DrawnDraft
from minimedusa.speed.fused_draft import fast_draft


def decoding_draft(spec: str | None, heads, model: Llama, heads_spec: str, context: bool,
                   draws: float | None = None, seed: int | None = None):
    """(draft, budget, describe) for decoding.medusa_decode as --tree asks: a fixed tree
    (budget.fixed: the paper's one tree every step), ranked:N (each step's N most probable
    nodes), or by default the nested trees and the Budget that picks among them and plain
    steps, ranked (draft.RankedDraft) with --tree ranked; with context candidates
    (context_candidates.ContextDraft) where `context`; Hydra++ heads' draft reads through their
    layer; candidates drawn from the heads at temperature `draws` where given (DrawnDraft, for
    speculative sampling; its draws seeded apart from the acceptance's coins). describe() says
    which, after the run (the sizes the budget used)."""
    if spec is not None and spec.startswith("ranked:"):
        size = ranked_size(spec)
        return (wrapped(RankedDraft(heads), heads, False), FixedSize(size),
                lambda: f"confidence-ranked tree of {size} nodes (--tree)")
    if spec is not None and spec != "ranked":
        name, tree = decoding_tree(spec, heads, model)
        draft, budget = fixed(heads, tree)
        return (wrapped(tree_draft(heads, draft.trees, model, draws, seed), heads, False), budget,
                lambda: f"tree {name} ({tree.size - 1} nodes, --tree)")
    trees, budget, why = decoding_budget(heads, model, heads_spec, context)
    draft = RankedDraft(heads) if spec == "ranked" else tree_draft(heads, trees, model, draws,
                                                                   seed)
    shape = "confidence-ranked tree" if spec == "ranked" else "tree"
    joined = " and context candidates" if context else ""
    return (wrapped(draft, heads, context), budget,
            lambda: f"{shape} of {budget.summary()}{joined}: {why}")


def tree_draft(heads, trees: dict, model: Llama, draws: float | None, seed: int | None):
    """The heads' guesses on the trees: their top-k (TreeDraft), or drawn at temperature
    `draws` (DrawnDraft); fused where speed fuses them."""
    if draws is None:
        return fast_draft(TreeDraft(heads, trees), model)
    return fast_draft(DrawnDraft(heads, trees, draws, None if seed is None else seed + 1), model)


def wrapped(draft, heads, context: bool):
    """The draft as a run needs it: read through a Hydra++ draft layer, with context chains."""
    draft = PlusPlusDraft(draft) if isinstance(heads, HydraPlusPlusHeads) else draft
    return ContextDraft(draft) if context else draft
