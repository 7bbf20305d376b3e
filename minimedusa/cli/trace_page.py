"""The page --trace writes: one self-contained HTML file (no network, no script: inline styles
and SVG) that shows a run's Medusa decoding as the paper draws it (Figure 2's tree of
candidates verified in one pass) and as the blog animates it (tokens arriving several at a
time, coloured by the head that guessed them).

From the top: the run (model, heads, tree, rule, format, machine, tokens/s), the answer
coloured as --show colours it, a chart of tokens per step along the answer, then a folded
section (<details>) a step: its tree, each node its candidate token, the head (depth) and rank
that guessed it and its probabilities (q under the heads, p under the verifier), the kept path
and the token the verifier added; and a table of the rule's numbers for the candidates it
judged along the kept path. trace.py notes what is drawn here.
"""
from html import escape

from minimedusa.cli.show import CONTEXT, DRAFT, MODEL, Painted
from minimedusa.cli.trace import Step, TracedDraft, rule_kind
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


def page(draft: TracedDraft, yielded: list[list[int]], tokenizer, header: dict) -> str:
    """The whole page, from the run's trace.TracedDraft (its steps' trace and the tokens'
    origins), the tokens each step yielded and the run's header (label -> value)."""
    rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>"
                   for k, v in header.items())
    sections = "".join(step_section(i, step, yielded[i], tokenizer, header["rule kind"])
                       for i, step in enumerate(draft.trace[:len(yielded)]))
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f"<title>minimedusa trace</title><style>{STYLE}</style></head><body>"
            f"<h1>Medusa decoding, step by step</h1><table>{rows}</table>"
            f"<h2>The answer</h2><p>{legend(draft.steps)}</p>"
            f'<div class="answer">{answer(draft, yielded, tokenizer)}</div>'
            f"<h2>Tokens per step</h2>{chart(yielded)}"
            f"<h2>Steps ({len(yielded)})</h2>{sections}</body></html>\n")


def css_class(origin) -> str:
    """The class a token of this origin is painted with (show.py's origins)."""
    return f"o-{origin}" if origin in (MODEL, CONTEXT, DRAFT) else f"h{(origin - 1) % 6 + 1}"


def span(text: str, origin) -> str:
    return f'<span class="{css_class(origin)}">{escape(text)}</span>' if text else ""


def legend(origins: list[list]) -> str:
    """Each origin that occurs in the answer, in its colour."""
    seen = sorted({o for step in origins for o in step if isinstance(o, int)})
    names = [(MODEL, "the model's own token")] + [(k, f"head {k}") for k in seen]
    names += [(o, n) for o, n in ((CONTEXT, "context candidate"), (DRAFT, "draft model"))
              if any(o in step for step in origins)]
    return " · ".join(span(name, origin) for origin, name in names)


def answer(draft: TracedDraft, yielded: list[list[int]], tokenizer) -> str:
    """The answer's text, each token in its origin's colour, as --show streams it."""
    painted = Painted(StreamDecoder(tokenizer), draft, paint=span)
    return "".join(painted.push(ids) for ids in yielded) + escape(painted.flush())


def chart(yielded: list[list[int]]) -> str:
    """Bars: the tokens each step yielded, along the answer."""
    top, width = max(len(ids) for ids in yielded), 6
    scale = 80 / top
    bars = "".join(f'<rect class="bar" x="{30 + i * width}" y="{90 - len(ids) * scale:.0f}" '
                   f'width="{width - 1}" height="{len(ids) * scale:.0f}"/>'
                   for i, ids in enumerate(yielded))
    return (f'<svg width="{40 + len(yielded) * width}" height="110" role="img">'
            f'<text x="0" y="14">{top}</text><text x="0" y="90">0</text>{bars}'
            f'<text x="30" y="106" class="small">step 0 … {len(yielded) - 1}</text></svg>')


def shown(tokenizer, token: int) -> str:
    """A token's text as a node's label: whitespace made visible, cut to fit a box."""
    text = tokenizer.decode([token]).replace(" ", "␣").replace("\n", "⏎")
    return text if len(text) <= 14 else text[:13] + "…"


def step_section(i: int, step: Step, ids: list[int], tokenizer, kind: str) -> str:
    """A folded section: what the step did in one line, its tree and the rule's numbers."""
    text = escape(tokenizer.decode(ids))
    if step.kind != "tree":
        what = ("the prompt's forward: the first token" if step.kind == "prefill"
                else "a plain step (the Budget chose no tree): one token")
        return f"<details><summary>step {i}: {what}: “{text}”</summary></details>"
    kept = len(step.kept) - 1
    summary = (f"step {i}: tree of {len(step.nodes) - 1} candidates, {kept} kept + the "
               f"verifier's token: “{text}”")
    return (f"<details><summary>{summary}</summary>{tree_svg(step, tokenizer)}"
            f"{numbers_table(step, tokenizer, kind)}</details>")


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


def tree_svg(step: Step, tokenizer) -> str:
    """The step's tree: a box a node (token; head and rank; q and p), the kept path in green,
    the verifier's token after it, dashed."""
    last = step.nodes[step.kept[-1]].path
    verifier = last + ("verifier",)
    place = layout([n.path for n in step.nodes] + [verifier])
    kept = {step.nodes[k].path for k in step.kept}
    parts = [edge(place[p[:-1]], place[p], p in kept or p == verifier) for p in place if p]
    for node in step.nodes:
        cls = "root" if not node.path else "kept" if node.path in kept else ""
        cls += " context" if node.origin == CONTEXT else ""
        parts.append(box(place[node.path], shown(tokenizer, node.token), label(node), cls))
    parts.append(box(place[verifier], shown(tokenizer, step.verifier), "the verifier's",
                     "verifier"))
    columns = 1 + max(c for c, _ in place.values())
    rows = 1 + max(r for _, r in place.values())
    return (f'<svg width="{columns * COL_W + 10}" height="{rows * ROW_H + 10}" '
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


def numbers_table(step: Step, tokenizer, kind: str) -> str:
    """The rule's numbers (rule_kind's) for the candidates it judged along the kept path: each
    kept node's children (speculative sampling: each child it judged, in order, its coin)."""
    if kind == "speculative":
        head = "<tr><th>candidate<th>r(x)<th>q(x)<th>coin u<th>verdict (u q &lt; r)"
        rows = [f"<tr><td>{escape(shown(tokenizer, step.nodes[c].token))}<td>{r:.3f}"
                f"<td>{q:.3f}<td>{u:.3f}<td>{'kept' if c in step.kept else 'rejected'}"
                for c, r, q, u in step.coins]
    else:
        head = ("<tr><th>at<th>candidate<th>p<th>" +
                {"greedy": "the model's argmax", "typical": "threshold",
                 "rejection": "drawn y ~ p"}[kind] + "<th>verdict")
        rows = [judged_row(step, parent, child, kind, tokenizer)
                for parent in step.kept for child in children_of(step, parent)]
    return f"<table>{head}{''.join(rows)}</table>"


def children_of(step: Step, parent: int) -> list[int]:
    path = step.nodes[parent].path
    return [i for i, n in enumerate(step.nodes) if n.path[:-1] == path and n.path]


def judged_row(step: Step, parent: int, child: int, kind: str, tokenizer) -> str:
    """One candidate a tree rule judged: its parent, its token, p, what p was held to."""
    at, node = step.judged_at.get(parent, {}), step.nodes[child]
    ruler = {"greedy": lambda: shown(tokenizer, at["argmax"]),
             "typical": lambda: f"{at['threshold']:.3f}",
             "rejection": lambda: shown(tokenizer, at["draw"])}[kind]()
    verdict = "kept" if child in step.kept else "rejected"
    return (f"<tr><td>{escape(shown(tokenizer, step.nodes[parent].token))}"
            f"<td>{escape(shown(tokenizer, node.token))}<td>{node.p:.3f}<td>{escape(ruler)}"
            f"<td>{verdict}")


def header_of(result: dict, recipe, machine: str) -> dict:
    """The page's header rows from generate.py's result and recipe."""
    return {"model": recipe.folder.name, "decoding (heads, tree, rule)": result["mode"],
            "rule kind": rule_kind(recipe),
            "format": f"{result['weights']}, {result['step']} step",
            "machine": machine, "tokens": result["new_tokens"],
            "tokens/s": result["tokens_per_s"], "steps": result["steps"],
            "tokens per step": result["acceleration_rate"]}
