"""--trace: what each step of Medusa decoding guessed, verified and kept, read off the steps the
loop yields (decoding.Step) for a page (trace_page.py draws it). For a tree step: the tree of
candidates (each node's token, the head and rank that guessed it, its probability q under what
drafted it: Candidates.q, where the draft has it), the nodes kept, the verifier's token, and the
rule's own numbers, as its Verdict holds them: greedy the argmax at each node; typical
acceptance p and its threshold; rejection sampling p and the token drawn at each node;
speculative sampling the residual r, q and the coin, child by child.

Tracing reads and never decodes: no forward, no draw and no wrapper of its own, so a traced
run is the run itself (a test holds its tokens to an untraced run's for every rule and seed).

Shapes: N tree nodes, P root-to-leaf paths, D max depth.
"""
import math
from dataclasses import dataclass

from minimedusa.cli.show import node_origin


@dataclass
class Node:
    """A candidate of a step's tree: its path (the root is ()), its token, its probability
    under what drafted it (q) and under the verifier at its parent (p, what the rule judged it
    by), each None where the step did not compute it, and what guessed it (show.node_origin)."""
    path: tuple
    token: int
    q: float | None
    p: float | None
    origin: object = None


def rule_of(numbers: dict) -> str:
    """The rule that decided, by the numbers its Verdict holds."""
    for name, rule in (("judged", "speculative"), ("threshold", "typical"),
                       ("draw", "rejection")):
        if name in numbers:
            return rule
    return "greedy"


def nodes_of(step) -> list[Node]:
    """The step's tree, a Node a node (step.candidates: a tree step)."""
    candidates = step.candidates
    tree, q = candidates.tree, candidates.q() if candidates.q is not None else None
    p, tokens = node_p(tree, step.verdict.numbers), candidates.tokens.tolist()
    return [Node(path, tokens[i], known(q[i].item()) if i and q is not None else None, p[i],
                 node_origin(candidates, i) if i else None)
            for i, path in enumerate(tree.nodes)]


def known(value: float) -> float | None:
    return None if math.isnan(value) else value


def node_p(tree, numbers: dict) -> list[float | None]:
    """Each node's p at its parent as the rule computed it: typical's and rejection's "p" (P, D),
    along each path; speculative sampling's r(x) where a child was first judged (r is p at a
    node's first child); None where the rule needs no p (greedy)."""
    p = [None] * tree.size
    if "p" in numbers:
        for path, valid, row in zip(tree.paths.tolist(), tree.path_valid.tolist(),
                                    numbers["p"].tolist()):
            for d, value in enumerate(row):
                if valid[d + 1]:
                    p[path[d + 1]] = value
    for child, r, _, _ in numbers.get("judged", []):
        p[child] = r if p[child] is None else p[child]
    return p


def children_of(nodes: list[Node], parent: int) -> list[int]:
    path = nodes[parent].path
    return [i for i, node in enumerate(nodes) if node.path and node.path[:-1] == path]


def judged(step, nodes: list[Node]) -> list[tuple]:
    """The candidates the rule judged along the kept path, as its numbers say: speculative
    sampling's (child, r(x), q_i(x), coin) in order; the other rules' (parent, child, p, what p
    was held to: the argmax there, the threshold, the token drawn there), each kept node's
    children."""
    numbers = step.verdict.numbers
    if "judged" in numbers:
        return numbers["judged"]
    name = {"greedy": "argmax", "typical": "threshold", "rejection": "draw"}[rule_of(numbers)]
    ruler = numbers[name].tolist()  # (N,)
    return [(parent, child, nodes[child].p, ruler[parent])
            for parent in step.kept for child in children_of(nodes, parent)]
