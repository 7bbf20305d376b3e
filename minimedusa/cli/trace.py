"""--trace: what each step of Medusa decoding guessed, verified and kept, noted for a page
(trace_page.py draws it). For every step: the tree of candidates the draft proposed (each
node's token, the head and rank that guessed it, its probability under the heads), the nodes
the acceptance kept, the token the verifier added, and the rule's own numbers for the
candidates it judged: greedy the model's argmax at each node; typical acceptance p and its
threshold; rejection sampling p and the token drawn at each node; speculative sampling p's
residual r, q and the coin, child by child.

Tracing observes and never decodes. TracedDraft is show.Watched (the draft's five verbs passed
through unchanged) that keeps each step's Candidates; the traced rule runs the rule's own
accept, then reads its numbers off the same logits. A rule that draws is replayed on a copy
of its generator, so the draws it reads are the ones the step made and the run's own
generator is not touched; the heads' probabilities are read by running the heads' reference
draft again (tree_tokens), never the one the run drafts with. A test holds a traced run's
tokens to an untraced one's for every rule and seed. What tracing cannot hide is its own time:
it counts in the step times an adapted Budget learns from, which may then pick other tree
sizes (the same greedy text whatever the tree; a sampled run compares with a fixed --tree).

Shapes: N tree nodes, V vocab.
"""
from dataclasses import dataclass, field, replace

import torch

from minimedusa.acceptance import Acceptance, draw, probabilities, typical_threshold
from minimedusa.cli.show import Watched, innermost
from minimedusa.draft import RankedDraft, TreeDraft, best_guesses, tree_tokens
from minimedusa.speculative_sampling import proposal_of, verify_drawn


@dataclass
class Node:
    """A candidate of a step's tree: its path (the root is ()), its token, its probability under
    what drafted it (q: the heads', or a draft model's; None where nothing drafted it: a
    context candidate a step of the chain alone) and under the verifier at its parent (p, at
    the rule's temperature: what the rule judged it by)."""
    path: tuple
    token: int
    q: float | None
    p: float | None
    origin: object = None  # what guessed it (show.py's: head depth k, CONTEXT or DRAFT)


@dataclass
class Step:
    """One step of the run, as the summary line counts them: "prefill" (the prompt's forward,
    which gives the first token), "plain" (a tree of the root alone: the Budget chose a plain
    step) or "tree"; for a tree step its nodes, the kept nodes' indices (root first), the
    verifier's token, the rule's numbers at each node it judged (node index -> {name: value})
    and, for speculative sampling, each child judged in order (child, r, q, coin)."""
    kind: str
    nodes: list[Node] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    verifier: int | None = None
    judged_at: dict = field(default_factory=dict)
    coins: list = field(default_factory=list)


class TracedDraft(Watched):
    """The run's draft, watched (show.Watched: each token's origin), keeping each step's trace
    (Step) in `trace`; the traced rule (traced_rule) adds the verdict to the step in hand."""

    def __init__(self, draft):
        super().__init__(draft, shown=False)
        self.trace, self.pending = [], None

    def start(self, prompt_ids: list[int], cache) -> None:
        super().start(prompt_ids, cache)
        self.trace, self.pending = [Step("prefill")], None

    def tree(self, model, n: int, root: int, features):
        candidates = super().tree(model, n, root, features)
        laws = drafted_laws(self.draft, model, candidates, root, features)
        token_of = dict(zip(candidates.tree.nodes, candidates.tokens.tolist()))
        self.pending = Step("tree")
        for path, token in token_of.items():
            line = [token_of[path[:d]] for d in range(1, len(path) + 1)]  # depth 1 to it
            origin = self.origin(line, len(path)) if path else None
            self.pending.nodes.append(Node(path, token, law_of(laws, path, token), None, origin))
        return candidates

    def extend(self, tokens: list[int]) -> None:
        super().extend(tokens)
        self.trace.append(self.pending if self.pending is not None else Step("plain"))
        self.pending = None


def drafted_laws(draft, model, candidates, root: int, features):
    """What each node's token was drafted from (speculative_sampling.Proposal: q at each
    parent): the drawn candidates' own, else the heads' softmax, by their reference draft run
    again on the step's tree (a context candidate read under the heads' guesses above it);
    None for a draft model's greedy chain or a tree deeper than the heads."""
    if candidates.proposal is not None:
        return candidates.proposal
    inner = innermost(draft)
    if not isinstance(inner, (TreeDraft, RankedDraft)):
        return None
    heads, tree = inner.heads, candidates.tree
    if tree.num_heads > heads.config.medusa_num_heads:
        return None
    calls = []

    def pick(logits, k):  # the heads' top-k, as the run's draft picks them, and their softmax
        columns = best_guesses(logits, k)
        calls.append((torch.softmax(logits.float(), dim=-1), columns))
        return columns

    with torch.inference_mode():
        tree_tokens(heads, model, tree, root, features, pick)
    return proposal_of(tree, calls, heads)


def law_of(laws, path: tuple, token: int) -> float | None:
    """q(token) at the node's parent, under the drafted laws (None: unknown)."""
    q = laws.q.get(path[:-1]) if laws is not None and path else None
    if q is None:
        return None
    if laws.ids is None:
        return q[token].item()
    column = (laws.ids == token).nonzero()
    return q[column[0, 0]].item() if len(column) else 0.0


def traced_rule(rule: Acceptance, draft: TracedDraft, recipe) -> Acceptance:
    """The rule, its accept run as it is, then its verdict and numbers added to the draft's
    step in hand (read on a copy of the generator as it was before the rule drew)."""
    def accept(logits, candidates, generator):
        before = copied(generator)
        nodes, new = rule.accept(logits, candidates, generator)
        step = draft.pending
        step.kept, step.verifier = nodes, new[-1]
        judge(recipe, step, logits, candidates, before)
        return nodes, new
    return replace(rule, accept=accept)


def copied(generator):
    """A generator in the same state (None stays None)."""
    if generator is None:
        return None
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def rule_kind(recipe) -> str:
    """The rule a step runs: the recipe's, greedy at temperature 0 (acceptance.py's limits)."""
    return "greedy" if recipe.temperature == 0 else recipe.acceptance


@torch.inference_mode()
def judge(recipe, step: Step, logits: torch.Tensor, candidates, generator) -> None:
    """The rule's numbers at the nodes it judged, into `step`: each node's p at its parent,
    and per parent what it compared them with (acceptance.py's rules, read, not rerun: a
    rule that draws replays its draws on `generator`, the run's as it was)."""
    kind, T = rule_kind(recipe), recipe.temperature
    tree = candidates.tree
    index = {path: i for i, path in enumerate(tree.nodes)}
    parents = sorted({index[path[:-1]] for path in tree.nodes[1:]})  # the nodes that judge
    if kind == "typical":
        probs = torch.softmax(logits.float() / T, dim=-1)  # (N, V), as the rule's
    elif kind == "greedy":
        probs = torch.softmax(logits.float(), dim=-1)  # at T = 1: for the reader
    else:
        probs = probabilities(logits, T, recipe.top_p)  # (N, V)
    argmax = logits.argmax(dim=-1).tolist()  # (N,)
    for node in parents:
        step.judged_at[node] = {"argmax": argmax[node]}
    if kind == "typical":
        thresholds = typical_threshold(probs, recipe.eps, recipe.delta).tolist()  # (N,)
        for node in parents:
            step.judged_at[node]["threshold"] = thresholds[node]
    if kind == "rejection":  # the rule's draws: y ~ p at every node, in its order
        draws = draw(probs, generator).tolist()  # (N,)
        for node in parents:
            step.judged_at[node]["draw"] = draws[node]
    if kind == "speculative":
        verify_drawn(lambda node: probabilities(logits[node], T, recipe.top_p), tree,
                     candidates.tokens, candidates.proposal, generator, step.coins)
    for node in step.nodes[1:]:
        node.p = probs[index[node.path[:-1]], node.token].item()


def traced(decoding, recipe):
    """The decoding with its draft traced (a TracedDraft, whose .trace a page is drawn from)
    and its rule's verdicts noted."""
    draft = TracedDraft(decoding.draft)
    return replace(decoding, draft=draft, acceptance=traced_rule(decoding.acceptance, draft,
                                                                 recipe))
