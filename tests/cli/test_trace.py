"""--trace (cli/trace.py, cli/trace_page.py): the page is read off the steps the loop yields,
which reading never changes (the same tokens, for every rule and seed, and the same page read
as the run goes or after it); the numbers it shows are the rule's own (each verdict follows
from them); the page has a folded section for every step of the summary line and no remote
reference; and where Chromium is installed, it renders the page without a console error."""
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from helpers import cycling_heads, cycling_model, POEM, REPO
from minimedusa.acceptance import greedy, rejection, typical
from minimedusa.budget import fixed
from minimedusa.assembly.recipe import Decoding
from minimedusa.cli.trace import judged, nodes_of
from minimedusa.context_candidates import ContextDraft
from minimedusa.speculative_sampling import DrawnDraft, speculative
from minimedusa.tree import build_tree

RULES = {"greedy": lambda T, seed: greedy(), "typical": lambda T, seed: typical(T),
         "rejection": lambda T, seed: rejection(T, 1.0, seed),
         "speculative": lambda T, seed: speculative(T, 1.0, seed)}


def decoding_of(kind: str, rule: str, seed: int) -> Decoding:
    """The one loop on a tiny model: greedy with context candidates, speculative sampling with
    drawn ones."""
    model = cycling_model(seed)
    heads = cycling_heads(model, kind, seed)
    tree = build_tree([[0], [1], [0, 0], [0, 0, 0], [1, 0]], heads.config.medusa_num_heads)
    draft, budget = fixed(heads, tree)
    T = 0.0 if rule == "greedy" else 0.8
    if rule == "speculative":
        draft = DrawnDraft(heads, {tree.size - 1: tree}, T, seed)
    if rule == "greedy":
        draft = ContextDraft(draft)
    return Decoding(model, lambda: rule, draft=draft, budget=budget,
                    acceptance=RULES[rule](T, seed))


def read(step):
    """What the page reads of a step: its nodes (tokens, q, p, origins) and the rule's rows."""
    if step.candidates is None:
        return None
    nodes = nodes_of(step)
    return nodes, judged(step, nodes)


def decoded(kind: str, rule: str, seed: int, reading: bool) -> tuple[list, list]:
    """(the steps, what the page reads of each, read as each came: None where not reading)."""
    steps, seen = [], []
    for step in decoding_of(kind, rule, seed).decode([3, 5, 7], 40, set()):
        steps.append(step)
        seen.append(read(step) if reading else None)
    return steps, seen


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("seed", [0, 1])
def test_reading_the_steps_changes_nothing_and_reads_the_same_after_the_run(kind, rule, seed):
    """The same tokens read step by step as when nothing reads them; and what was read of each
    step as it came is what reading it after the run gives (a step's values are its own, not
    a buffer a later step overwrites)."""
    steps, _ = decoded(kind, rule, seed, reading=False)
    read_steps, seen = decoded(kind, rule, seed, reading=True)
    assert [s.tokens for s in read_steps] == [s.tokens for s in steps]
    assert seen == [read(step) for step in read_steps]
    assert any(len(step.kept) > 1 for step in read_steps[1:])  # guesses were kept: it can see


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_verdict_follows_from_the_rules_own_numbers(rule, seed):
    """greedy keeps a child iff it is its parent's argmax; rejection sampling iff it is the
    token drawn there; typical acceptance iff its p passes the threshold; speculative sampling
    iff its coin u q < r; and each step's last token is the verifier's."""
    steps, _ = decoded("hydra", rule, seed, reading=False)
    for step in steps[1:-1]:  # the last: cut short
        if step.candidates is None:
            continue
        nodes = nodes_of(step)
        assert step.tokens[-1] == step.verdict.tokens[-1] and len(step.tokens) == len(step.kept)
        assert step.tokens[:-1] == [nodes[k].token for k in step.kept[1:]]
        if rule == "speculative":
            kept = [child for child, r, q, coin in judged(step, nodes) if coin * q < r]
            assert kept == step.kept[1:]
            continue
        threshold = step.verdict.numbers.get("threshold")
        for parent, child, p, held in judged(step, nodes):
            passes = {"greedy": nodes[child].token == held,
                      "rejection": nodes[child].token == held,
                      "typical": p is not None and threshold is not None and p > held}[rule]
            assert passes == (child in step.kept), (rule, nodes[child], held)


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
    """generate.py --trace on the default model: (the page's path, its summary line, its
    answer)."""
    path = tmp_path_factory.mktemp("trace") / "trace.html"
    done = subprocess.run([sys.executable, str(REPO / "generate.py"), *POEM, "--trace",
                           str(path)], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return path, done.stderr.strip().splitlines()[-1], done.stdout


def test_the_page_has_a_folded_section_a_step_and_no_remote_reference(traced_run):
    path, summary, _ = traced_run
    text = path.read_text(encoding="utf-8")
    page = Page()
    page.feed(text)
    steps = int(re.search(r"(\d+) steps", summary).group(1))
    assert page.sections == steps
    assert page.remote == [] and "url(" not in text and "@import" not in text
    assert "<svg" in text and "verifier" in text


def test_a_traced_greedy_answer_is_the_untraced_one(traced_run, poem_answer):
    _, _, traced_text = traced_run
    assert traced_text == poem_answer and traced_text.strip()


def test_headless_chromium_renders_the_page_without_console_errors(traced_run, tmp_path):
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                    if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no Chromium here (Debian: apt install chromium): the page is not rendered")
    path, _, _ = traced_run
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
