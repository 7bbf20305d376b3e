"""The page --trace writes: one self-contained HTML file (no network, no script: inline styles
and SVG) that shows a run's Medusa decoding as the paper draws it (Figure 2's tree of
candidates verified in one pass) and as the blog animates it (tokens arriving several at a
time, coloured by the head that guessed them).

From the top: the run (model, heads, tree, rule, format, machine, tokens/s), the answer
coloured as --show colours it, a chart of tokens per step along the answer, then a folded
section (<details>) a step: its tree, each node its candidate token, the head (depth) and rank
that guessed it and its probabilities (q under what drafted it, p under the verifier), the
kept path and the token the verifier added; and a table of the rule's numbers for the
candidates it judged along the kept path. The skeleton is a jinja2 template (trace_page.html,
which escapes every text it is given); the SVG is drawn here. trace.py reads the steps.
"""
from html import escape
from pathlib import Path

import jinja2
from markupsafe import Markup

from minimedusa.cli.show import CONTEXT, DRAFT, MODEL, Painted, origins
from minimedusa.cli.trace import judged, nodes_of, rule_of
from minimedusa.files.tokenizer import StreamDecoder

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:70em;color:#222}
table{border-collapse:collapse}td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left}
.answer{white-space:pre-wrap;font-family:monospace;border:1px solid #ccc;padding:1em}
.o-model{color:#222}.o-context{color:#c0392b;text-decoration:underline}.o-draft{color:#008b8b}
.h1{color:#1e8449}.h2{color:#b7950b}.h3{color:#1f4e9c}.h4{color:#8e44ad}.h5{color:#117a8b}
.h6{color:#27ae60}
svg text{font:11px monospace}svg .small{font-size:9px;fill:#555}
rect{fill:#fff;stroke:#999}.kept rect{fill:#d5f5e3;stroke:#1e8449;stroke-width:2}
.context rect{stroke:#c0392b}.root rect{fill:#eee}
.verifier rect{fill:#fdebd0;stroke:#d35400;stroke-dasharray:4 2}
line{stroke:#aaa}line.kept{stroke:#1e8449;stroke-width:2}.bar{fill:#5dade2}
summary{cursor:pointer}details{margin:.3em 0}
"""
BOX_W, BOX_H, COL_W, ROW_H = 118, 30, 134, 36
TEMPLATE = Path(__file__).parent / "trace_page.html"
# each rule's table: its columns (speculative sampling's a row a child judged, in order)
HEADS = {"speculative": ("candidate", "r(x)", "q(x)", "coin u", "verdict (u q < r)"),
         "greedy": ("at", "candidate", "p", "the model's argmax", "verdict"),
         "typical": ("at", "candidate", "p", "threshold", "verdict"),
         "rejection": ("at", "candidate", "p", "drawn y ~ p", "verdict")}


def page(steps: list, tokenizer, header: dict) -> str:
    """The whole page, from the run's steps (decoding.Step, as the loop yielded them) and its
    header (label -> value: header_of)."""
    answer = []  # (css class, text) a token, as --show paints it
    painted = Painted(StreamDecoder(tokenizer),
                      lambda text, origin: answer.append((css_class(origin), text)) or "")
    for step in steps:
        painted.push(step)
    answer.append(("", painted.flush()))
    seen = {origin for step in steps for origin in origins(step)}
    template = jinja2.Environment(autoescape=True).from_string(
        TEMPLATE.read_text(encoding="utf-8"))
    return template.render(style=STYLE, header=header, legend=answer_legend(seen), answer=answer,
                           chart=chart(steps), sections=[
                               section(i, step, tokenizer) for i, step in enumerate(steps)])


def css_class(origin) -> str:
    """The class a token of this origin is painted with (show.py's origins)."""
    return f"o-{origin}" if origin in (MODEL, CONTEXT, DRAFT) else f"h{(origin - 1) % 6 + 1}"


def answer_legend(seen: set) -> list[tuple[str, str]]:
    """(css class, name) of each origin that occurs in the answer, the model's first."""
    names = [(MODEL, "the model's own token")]
    names += [(k, f"head {k}") for k in sorted(o for o in seen if isinstance(o, int))]
    names += [(o, n) for o, n in ((CONTEXT, "context candidate"), (DRAFT, "draft model"))
              if o in seen]
    return [(css_class(origin), name) for origin, name in names]


def chart(steps: list) -> Markup:
    """Bars: the tokens each step yielded, along the answer."""
    top, width = max(len(step.tokens) for step in steps), 6
    scale = 80 / top
    bars = "".join(f'<rect class="bar" x="{30 + i * width}" y="{90 - len(s.tokens) * scale:.0f}" '
                   f'width="{width - 1}" height="{len(s.tokens) * scale:.0f}"/>'
                   for i, s in enumerate(steps))
    return Markup(f'<svg width="{40 + len(steps) * width}" height="110" role="img">'
                  f'<text x="0" y="14">{top}</text><text x="0" y="90">0</text>{bars}'
                  f'<text x="30" y="106" class="small">step 0 … {len(steps) - 1}</text></svg>')


def shown(tokenizer, token: int) -> str:
    """A token's text as a node's label: whitespace made visible, cut to fit a box."""
    text = tokenizer.decode([token]).replace(" ", "␣").replace("\n", "⏎")
    return text if len(text) <= 14 else text[:13] + "…"


def section(i: int, step, tokenizer) -> dict:
    """A folded section: what the step did in one line; a tree step's tree and rule table."""
    text = tokenizer.decode(step.tokens)
    if step.candidates is None:
        what = ("the prompt's forward: the first token" if i == 0
                else "a plain step (the Budget chose no tree): one token")
        return {"summary": f"step {i}: {what}: “{text}”"}
    nodes = nodes_of(step)
    head, rows = table(step, nodes, tokenizer)
    return {"summary": f"step {i}: tree of {len(nodes) - 1} candidates, {len(step.kept) - 1} kept"
                       f" + the verifier's token: “{text}”",
            "tree": tree_svg(step, nodes, tokenizer), "head": head, "rows": rows}


def table(step, nodes, tokenizer) -> tuple[tuple, list[list[str]]]:
    """The rule's numbers for the candidates it judged (trace.judged), as a table's cells."""
    verdict = lambda child: "kept" if child in step.kept else "rejected"  # noqa: E731
    said = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    kind = rule_of(step.verdict.numbers)
    if kind == "speculative":
        return HEADS[kind], [[shown(tokenizer, nodes[c].token), said(r), said(q), said(u),
                              verdict(c)] for c, r, q, u in judged(step, nodes)]
    ruler = said if kind == "typical" else (lambda token: shown(tokenizer, token))
    token = lambda node: shown(tokenizer, nodes[node].token)  # noqa: E731
    return HEADS[kind], [[token(parent), token(child), said(p), ruler(held), verdict(child)]
                         for parent, child, p, held in judged(step, nodes)]


def layout(paths: list[tuple]) -> dict:
    """Each path's (column, row): columns by depth, rows in depth-first order, siblings by
    rank, a parent on its first child's row."""
    children: dict = {}
    for path in paths[1:]:
        children.setdefault(path[:-1], []).append(path)
    place, row = {}, [0]

    def visit(path, depth):
        kids = sorted(children.get(path, []), key=lambda p: (isinstance(p[-1], str), p))
        place[path] = (depth, row[0])
        for n, kid in enumerate(kids):
            if n:
                row[0] += 1
            visit(kid, depth + 1)
    visit((), 0)
    return place


def tree_svg(step, nodes, tokenizer) -> Markup:
    """The step's tree: a box a node (token; head and rank; q and p), the kept path in green,
    the verifier's token after it, dashed."""
    verifier = nodes[step.kept[-1]].path + ("verifier",)
    place = layout([n.path for n in nodes] + [verifier])
    kept = {nodes[k].path for k in step.kept}
    parts = [edge(place[p[:-1]], place[p], p in kept or p == verifier) for p in place if p]
    for node in nodes:
        cls = "root" if not node.path else "kept" if node.path in kept else ""
        cls += " context" if node.origin == CONTEXT else ""
        parts.append(box(place[node.path], shown(tokenizer, node.token), label(node), cls))
    parts.append(box(place[verifier], shown(tokenizer, step.verdict.tokens[-1]),
                     "the verifier's", "verifier"))
    columns = 1 + max(c for c, _ in place.values())
    rows = 1 + max(r for _, r in place.values())
    return Markup(f'<svg width="{columns * COL_W + 10}" height="{rows * ROW_H + 10}" '
                  f'role="img">{"".join(parts)}</svg>')


def label(node) -> str:
    """A node's second line: head (its depth) and rank, q under the heads, p under the rule."""
    if not node.path:
        return "root"
    q = "" if node.q is None else f" q{node.q:.2f}"
    p = "" if node.p is None else f" p{node.p:.2f}"
    by = {CONTEXT: "context", DRAFT: "draft"}.get(node.origin, f"h{len(node.path)}")
    return f"{by} r{node.path[-1]}{q}{p}"


def box(place: tuple, text: str, small: str, cls: str) -> str:
    x, y = 5 + place[0] * COL_W, 5 + place[1] * ROW_H
    return (f'<g class="{cls}" transform="translate({x},{y})"><rect width="{BOX_W}" '
            f'height="{BOX_H}" rx="4"/><text x="5" y="12">{escape(text)}</text>'
            f'<text x="5" y="25" class="small">{escape(small)}</text></g>')


def edge(parent: tuple, child: tuple, kept: bool) -> str:
    x1, y1 = 5 + parent[0] * COL_W + BOX_W, 5 + parent[1] * ROW_H + BOX_H // 2
    x2, y2 = 5 + child[0] * COL_W, 5 + child[1] * ROW_H + BOX_H // 2
    style = ' class="kept"' if kept else ""
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}"{style}/>'


def header_of(result: dict, recipe, decoding, machine: str) -> dict:
    """The page's header rows from generate.py's result, recipe and decoding."""
    rule = decoding.acceptance.name if decoding.acceptance is not None else "plain decoding"
    return {"model": recipe.folder.name, "decoding (heads, tree, rule)": result["mode"],
            "rule": rule, "format": f"{result['weights']}, {result['step']} step",
            "machine": machine, "tokens": result["new_tokens"],
            "tokens/s": result["tokens_per_s"], "steps": result["steps"],
            "tokens per step": result["acceleration_rate"]}
