"""--trace (cli/trace.py, cli/trace_page.py): tracing never changes what is decoded, for every
rule and seed; the numbers it notes are the rule's own (each verdict follows from them); the
page has a folded section for every step of the summary line and no remote reference; and
where Chromium is installed, it renders the page without a console error."""
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from helpers import REPO, cycling_heads, cycling_model
from minimedusa.acceptance import greedy, rejection, typical
from minimedusa.budget import fixed
from minimedusa.assembly.recipe import Decoding, Recipe
from minimedusa.cli.trace import traced
from minimedusa.context_candidates import ContextDraft
from minimedusa.speculative_sampling import DrawnDraft, speculative
from minimedusa.tree import build_tree

RULES = {"greedy": lambda T, seed: greedy(), "typical": lambda T, seed: typical(T),
         "rejection": lambda T, seed: rejection(T, 1.0, seed),
         "speculative": lambda T, seed: speculative(T, 1.0, seed)}


def decoded(kind: str, rule: str, seed: int, trace: bool):
    """A run of the one loop on a tiny model, its decoding traced or not: (steps, the
    decoding). Greedy runs with context candidates, speculative sampling with drawn ones."""
    model = cycling_model(seed)
    heads = cycling_heads(model, kind, seed)
    tree = build_tree([[0], [1], [0, 0], [0, 0, 0], [1, 0]], heads.config.medusa_num_heads)
    draft, budget = fixed(heads, tree)
    T = 0.0 if rule == "greedy" else 0.8
    if rule == "speculative":
        draft = DrawnDraft(heads, {tree.size - 1: tree}, T, seed)
    if rule == "greedy":
        draft = ContextDraft(draft)
    decoding = Decoding(model, lambda: rule, draft=draft, budget=budget,
                        acceptance=RULES[rule](T, seed))
    if trace:
        recipe = Recipe(folder=Path("."), device=torch.device("cpu"), weight_format="float32",
                        acceptance=rule, temperature=T, seed=seed)
        decoding = traced(decoding, recipe)
    return list(decoding.decode([3, 5, 7], 40, set())), decoding


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("seed", [0, 1])
def test_tracing_never_changes_what_is_decoded(kind, rule, seed):
    steps, _ = decoded(kind, rule, seed, trace=False)
    traced_steps, decoding = decoded(kind, rule, seed, trace=True)
    assert traced_steps == steps
    trace = decoding.draft.trace
    assert len(trace) == len(steps) and trace[0].kind == "prefill"
    assert any(len(step.kept) > 1 for step in trace[1:])  # guesses were kept: a test that can see


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_verdict_follows_from_the_rules_noted_numbers(rule, seed):
    """greedy keeps a child iff it is its parent's argmax; rejection sampling iff it is the
    token drawn there; typical acceptance iff its p passes the threshold; speculative sampling
    iff its coin u q < r; and each step's last token is the verifier's."""
    steps, decoding = decoded("hydra", rule, seed, trace=True)
    for tokens, step in zip(steps[1:-1], decoding.draft.trace[1:-1]):  # the last: cut short
        if step.kind != "tree":
            continue
        assert tokens[-1] == step.verifier and len(tokens) == len(step.kept)
        if rule == "speculative":
            kept = [child for child, r, q, coin in step.coins if coin * q < r]
            assert kept == step.kept[1:]
            continue
        for parent in step.kept:
            at = step.judged_at.get(parent, {})  # a leaf judged nothing
            for child, node in enumerate(step.nodes):
                if node.path[:-1] != step.nodes[parent].path or not node.path:
                    continue
                passes = {"greedy": node.token == at["argmax"],
                          "rejection": node.token == at.get("draw"),
                          "typical": node.p > at.get("threshold", 2.0)}[rule]
                assert passes == (child in step.kept), (rule, node, at)


POEM = ["--prompt", "Write a short poem about the sea.", "--max-new-tokens", "64"]


class Page(HTMLParser):
    """The page's sections, and every reference it makes to something outside it."""

    def __init__(self):
        super().__init__()
        self.sections, self.remote = 0, []

    def handle_starttag(self, tag, attrs):
        self.sections += tag == "details"
        self.remote += [(tag, k, v) for k, v in attrs if k in ("src", "href", "srcset", "data")]
        self.remote += [(tag,)] if tag in ("script", "link", "iframe", "img", "object") else []


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """generate.py --trace on the default model: (the page's path, its summary line)."""
    path = tmp_path_factory.mktemp("trace") / "trace.html"
    done = subprocess.run([sys.executable, str(REPO / "generate.py"), *POEM, "--trace",
                           str(path)], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    plain = subprocess.run([sys.executable, str(REPO / "generate.py"), *POEM],
                           capture_output=True, text=True, cwd=REPO, timeout=600)
    return path, done.stderr.strip().splitlines()[-1], done.stdout, plain.stdout


def test_the_page_has_a_folded_section_a_step_and_no_remote_reference(traced_run):
    path, summary, _, _ = traced_run
    text = path.read_text(encoding="utf-8")
    page = Page()
    page.feed(text)
    steps = int(re.search(r"(\d+) steps", summary).group(1))
    assert page.sections == steps
    assert page.remote == [] and "url(" not in text and "@import" not in text
    assert "<svg" in text and "verifier" in text


def test_a_traced_greedy_answer_is_the_untraced_one(traced_run):
    _, _, traced_text, plain_text = traced_run
    assert traced_text == plain_text and traced_text.strip()


def test_headless_chromium_renders_the_page_without_console_errors(traced_run, tmp_path):
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                    if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no Chromium here (Debian: apt install chromium): the page is not rendered")
    path, _, _, _ = traced_run
    shot = tmp_path / "trace.png"
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                           "--enable-logging=stderr", "--v=0", f"--screenshot={shot}",
                           "--window-size=1000,1400", path.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 10_000, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    assert console == [], console


@pytest.mark.parametrize("flags", [["--prompts", "PROMPTS"], ["--baseline"], ["--chat"]])
def test_trace_where_it_cannot_draw_is_one_line(flags, tmp_path):
    from generate import main as generate_main
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hi\n")
    flags = [str(prompts) if f == "PROMPTS" else f for f in flags]
    with pytest.raises(SystemExit) as end:
        generate_main([*flags, "--prompt", "Hi", "--trace", str(tmp_path / "t.html")]
                      if "--prompts" not in flags else [*flags, "--trace", str(tmp_path / "t.html")])
    assert end.value.code == 2


def test_a_trace_file_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    from generate import main as generate_main
    for where in (tmp_path / "no" / "t.html", tmp_path):  # no such folder; a folder
        with pytest.raises(SystemExit) as end:
            generate_main(["--prompt", "Hi", "--trace", str(where)])
        said = str(end.value.code)
        assert said.startswith("error: --trace") and "\n" not in said
