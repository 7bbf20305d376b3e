"""--show (cli/show.py): on a terminal, the answer streams with each token coloured by what
guessed it (several colours where the heads' guesses are accepted); through a pipe, the same
text as without --show, no escape codes; and every token yielded, for every acceptance rule
and seed, has the origin of the node that kept it."""
import re

import pytest
import torch

from helpers import cycling_heads, cycling_model, generate_output, POEM
from minimedusa.acceptance import greedy, rejection, typical
from minimedusa.budget import fixed
from minimedusa.cli.show import COLOURS, HEAD_COLOURS, node_origin, origins
from minimedusa.context_candidates import ContextDraft
from minimedusa.decoding import medusa_decode
from minimedusa.draft import Candidates
from minimedusa.speculative_sampling import DrawnDraft, speculative
from minimedusa.tree import build_tree

ESCAPES = [re.escape(c) for c in (*HEAD_COLOURS, *COLOURS.values())]


@pytest.mark.slow  # a process of the default model (test_trace.py's runs in the default run)
def test_on_a_terminal_the_answer_streams_in_several_colours(poem_answer):
    """--show on a terminal (without --show: conftest's poem_answer)."""
    out = generate_output([*POEM, "--show"], terminal=True)
    colours = {code for code in ESCAPES if re.search(code, out)}
    assert len(colours) >= 3  # heads' depths and context candidates (the model's: plain)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert plain.replace("\r\n", "\n") == poem_answer  # a terminal writes \r\n


@pytest.mark.slow  # a process of the default model
def test_through_a_pipe_show_writes_the_same_text_without_escape_codes(poem_answer):
    out = generate_output([*POEM, "--show"], terminal=False)
    assert "\x1b[" not in out and out == poem_answer


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("rule", ["greedy", "typical", "rejection", "speculative"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_token_yielded_has_its_kept_nodes_origin(kind, rule, seed):
    """Each step's tokens get an origin each, read off the step: a kept node's (head k at depth
    k, or the context chain's), then the model's own token; guesses are seen where the heads'
    were accepted. For every rule and seed."""
    model = cycling_model(seed)
    heads = cycling_heads(model, kind, seed)
    tree = build_tree([[0], [1], [0, 0], [0, 0, 0], [1, 0]], heads.config.medusa_num_heads)
    draft, budget = fixed(heads, tree)
    if rule == "speculative":
        draft = DrawnDraft(heads, {tree.size - 1: tree}, 0.8, seed)
    rules = {"greedy": lambda: greedy(), "typical": lambda: typical(0.8),
             "rejection": lambda: rejection(0.8, 1.0, seed),
             "speculative": lambda: speculative(0.8, 1.0, seed)}
    inner = ContextDraft(draft) if rule == "greedy" else draft
    steps = list(medusa_decode(model, inner, budget, rules[rule](), [3, 5, 7], 40, set()))
    for step in steps:
        said = origins(step)
        assert len(said) == len(step.tokens) and said[len(step.kept) - 1:] in ([], ["model"])
        if step.candidates is not None:
            paths = [step.candidates.tree.nodes[k] for k in step.kept[1:]]
            assert all(o in ("context", len(p)) for o, p in zip(said, paths))
    assert any(o != "model" for step in steps for o in origins(step))  # guesses were accepted


def test_show_with_prompts_or_json_is_one_line(tmp_path):
    from generate import main as generate_main
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hi\n")
    for flags in (["--prompts", str(prompts)], ["--prompt", "Hi", "--json"]):
        with pytest.raises(SystemExit) as end:
            generate_main([*flags, "--show"])
        assert end.value.code == 2


def test_a_context_candidate_is_told_from_a_heads_guess():
    """show.node_origin: a node on the step's context chain is the chain's; others the head of
    their depth, or a draft model's."""
    tree = build_tree([[0], [0, 0], [1]])
    chained = Candidates(tree, torch.tensor([5, 6, 7, 8]), {}, context=((0,), (0, 0)))
    assert [node_origin(chained, i) for i in (1, 2, 3)] == ["context", 1, "context"]
    drafted = Candidates(tree, torch.tensor([5, 6, 7, 8]), {}, drafter="draft model")
    assert node_origin(drafted, 2) == "draft"
