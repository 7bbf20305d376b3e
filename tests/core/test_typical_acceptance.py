"""Typical acceptance (paper section 3.3) on hand-built logits, where every number is known: a
candidate x at a node is accepted iff p(x) > min(eps, delta * exp(-H(p))), p the backbone's
distribution at temperature T; among the longest accepted paths the most likely wins; the next
token is the argmax at the last accepted node. Each test puts a candidate just above and just
below one term of the threshold, so a rule without that term (or without a threshold) fails."""
import math

import pytest
import torch

from minimedusa.acceptance import typical_acceptance
from minimedusa.tree import build_tree

MARGIN = 1e-3  # how far above or below the threshold a candidate is put (relative)


def logits_of(probabilities: list[float], temperature: float = 1.0) -> torch.Tensor:
    """Logits whose softmax at `temperature` is `probabilities`: T log p."""
    return temperature * torch.tensor(probabilities, dtype=torch.float64).log()


def entropy(probabilities: list[float]) -> float:
    return -sum(p * math.log(p) for p in probabilities if p > 0)


def one_child(root: list[float], candidate: int, temperature: float, eps: float, delta: float):
    """(accepted length, next token) of a tree of one candidate under the root."""
    tree = build_tree([[0]], num_heads=1)
    logits = torch.stack([logits_of(root, temperature), torch.zeros(len(root))])  # (N, V)
    tokens = torch.tensor([0, candidate])  # (N,): the root's own token, then the candidate
    _, length, next_token, _ = typical_acceptance(logits, tree, tokens, None, temperature, eps,
                                               delta)
    return int(length), int(next_token)


ROOT = [0.5, 0.3, 0.15, 0.05]  # candidate 1: p = 0.3


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("side", [1 + MARGIN, 1 - MARGIN])
def test_the_hard_threshold_eps_accepts_just_above_and_rejects_just_below(side, temperature):
    eps = ROOT[1] / side  # side > 1: the threshold just below p(x)
    length, _ = one_child(ROOT, 1, temperature, eps, delta=100.0)  # delta's term out of reach
    assert length == (1 if side > 1 else 0)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("side", [1 + MARGIN, 1 - MARGIN])
def test_the_entropy_threshold_accepts_just_above_and_rejects_just_below(side, temperature):
    delta = ROOT[1] * math.exp(entropy(ROOT)) / side  # delta exp(-H) just below or above p(x)
    length, _ = one_child(ROOT, 1, temperature, eps=1.0, delta=delta)
    assert length == (1 if side > 1 else 0)


def test_the_same_probability_passes_where_the_distribution_is_flatter():
    """The entropy term: p(x) = 0.3 is accepted where the rest is spread (higher entropy: a
    lower threshold), rejected where it is concentrated, at the same delta."""
    peaked, flat = [0.7, 0.3] + [0.0] * 8, [0.3, 0.3] + [0.4 / 8] * 8
    assert entropy(flat) > entropy(peaked)
    delta = 0.3 * math.exp(0.5 * (entropy(flat) + entropy(peaked)))  # between the two
    assert one_child(flat, 1, 1.0, eps=1.0, delta=delta)[0] == 1
    assert one_child(peaked, 1, 1.0, eps=1.0, delta=delta)[0] == 0


def test_the_threshold_reads_p_at_the_temperature_asked():
    """p(x) at T: a candidate that passes at T = 1 fails at T = 0.5, where the distribution is
    sharper and its probability lower, with the same logits."""
    logits_probabilities = [0.5, 0.3, 0.15, 0.05]
    sharp = torch.softmax(logits_of(logits_probabilities) / 0.5, dim=-1)[1].item()  # 0.24
    eps = 0.27  # between p(x) at T = 1 (0.3) and at T = 0.5
    assert sharp < eps < 0.3
    tree = build_tree([[0]], num_heads=1)
    logits = torch.stack([logits_of(logits_probabilities), logits_of([0.7, 0.1, 0.1, 0.1])])
    for temperature, accepted in ((1.0, 1), (0.5, 0)):
        _, length, _, _ = typical_acceptance(logits, tree, torch.tensor([0, 1]), None, temperature,
                                          eps, 100.0)
        assert int(length) == accepted


@pytest.mark.parametrize("order", [(1, 2), (2, 1)])
def test_between_equally_long_paths_the_more_likely_wins(order):
    """Two candidates under the root, both above the threshold: the chosen path is the one
    whose candidate is more probable, whichever rank it holds."""
    tree = build_tree([[0], [1]], num_heads=1)
    root = [0.1, 0.5, 0.35, 0.05]  # tokens 1 and 2 both pass eps = 0.09
    logits = torch.stack([logits_of(root)] + [logits_of([0.7, 0.1, 0.1, 0.1])] * 2)
    tokens = torch.tensor([0, *order])  # nodes 1 and 2 hold tokens order[0] and order[1]
    path, length, _, _ = typical_acceptance(logits, tree, tokens, None, 1.0, 0.09, 0.3)
    last = tree.paths[path, length]
    assert int(length) == 1 and int(tokens[last]) == 1  # token 1, p = 0.5 over 0.35


def test_the_next_token_is_the_argmax_at_the_last_accepted_node():
    tree = build_tree([[0], [0, 0]], num_heads=2)
    logits = torch.stack([logits_of([0.1, 0.8, 0.05, 0.05]),  # root: candidate 1 passes
                          logits_of([0.05, 0.05, 0.1, 0.8]),  # node 1: candidate 2 fails
                          logits_of([0.9, 0.05, 0.03, 0.02])])
    path, length, next_token, _ = typical_acceptance(logits, tree, torch.tensor([0, 1, 2]), None,
                                                  1.0, 0.2, 0.3)
    assert int(length) == 1 and int(tree.paths[path, length]) == 1
    assert int(next_token) == 3  # node 1's argmax, not a sample, not node 2's
