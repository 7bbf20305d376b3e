"""The benchmark's report: totals in the paper's terms (section 7), the tables and the plot.

Acceleration rate (tokens per step), overhead (step latency / plain step latency) and speedup
(tokens/s / plain tokens/s), per engine overall and per MT-Bench category, from the rows that
bench.py measured; a markdown table of each, and (if matplotlib is installed) a PNG.
"""
import sys
from pathlib import Path

from minimedusa.files.outputs import write_atomically


def summarize(rows: list[dict], engines: list[str], reference: str = "plain") -> dict:
    """Totals per engine in the paper's terms, relative to the `reference` engine (this
    project's plain decoding, unless --reference names another)."""
    totals = {}
    for e in engines:
        tokens = sum(r[e]["tokens"] for r in rows)
        seconds = sum(r[e]["seconds"] for r in rows)
        steps = sum(r[e]["steps"] for r in rows)
        totals[e] = {"tokens": tokens, "seconds": round(seconds, 3), "steps": steps,
                     "tokens_per_s": round(tokens / seconds, 2),
                     "acceleration_rate": round(tokens / steps, 3),
                     "step_ms": round(1000 * seconds / steps, 2),
                     "identical": sum(r[e]["same_as_plain"] for r in rows),
                     "questions": len(rows)}
        checked = [r[e].get("same_as_reference") for r in rows]
        if rows and None not in checked:  # greedy engines, where bench checked them
            totals[e]["same_as_reference"] = sum(checked)
    plain = totals[reference]
    for t in totals.values():
        t["overhead"] = round(t["step_ms"] / plain["step_ms"], 3)
        t["speedup"] = round(t["tokens_per_s"] / plain["tokens_per_s"], 3)
    return totals


def markdown(totals: dict, expected: dict) -> str:
    lines = ["| engine | tokens/s | tokens/step | expected | step ms | overhead | speedup | "
             "same as plain | same as the reference | weights MB/step | GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in totals.items():
        estimate = f"{expected[name]:.2f}" if name in expected else ""
        same = f"{t['identical']}/{t['questions']}" if "T=" not in name else "(sampled)"
        reference = (f"{t['same_as_reference']}/{t['questions']}" if "same_as_reference" in t
                     else "")
        mb = f"{t['weight_bytes'] / 1e6:.1f}" if "weight_bytes" in t else ""
        lines.append(f"| {name} | {t['tokens_per_s']:.1f} | {t['acceleration_rate']:.2f} | "
                     f"{estimate} | {t['step_ms']:.1f} | {t['overhead']:.2f}x | "
                     f"{t['speedup']:.2f}x | {same} | {reference} | {mb} | "
                     f"{t.get('gb_s', '')} |")
    return "\n".join(lines)


def category_table(per_category: dict) -> str:
    names = list(next(iter(per_category.values())))[1:]  # every engine but plain
    lines = ["| category | " + " | ".join(f"{n}: tokens/step, speedup" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for category, totals in per_category.items():
        cells = [f"{totals[n]['acceleration_rate']:.2f}, {totals[n]['speedup']:.2f}x"
                 for n in names]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Speedup per category, and tokens/s against tree size; only if matplotlib is there."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    sized = {int(n.split()[-2]): t for n, t in result["totals"].items()
             if n.endswith(" nodes") and " ranked " not in n}
    fig, axes = plt.subplots(1, 2 if sized else 1, figsize=(12 if sized else 7, 4), squeeze=False)
    ax = axes[0][0]
    categories = list(result["per_category"])
    engines = [n for n in result["totals"] if n != "plain" and not n.endswith(" nodes")]
    width = 0.8 / len(engines)
    for j, name in enumerate(engines):
        ax.bar([i + j * width for i in range(len(categories))],
               [result["per_category"][c][name]["speedup"] for c in categories], width,
               label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))], categories,
                  rotation=30)
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=7)
    if sized:
        ax = axes[0][1]
        sizes = sorted(sized)
        ax.plot(sizes, [sized[n]["tokens_per_s"] for n in sizes], "o-", label="Medusa greedy")
        ax.axhline(result["totals"]["plain"]["tokens_per_s"], color="gray", ls="--",
                   label="plain")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree size (nodes)")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['device_name']}, {result['dtype']}, {result['threads']} threads, "
                 f"{result['max_new_tokens']} tokens per question")
    fig.tight_layout()
    # aside, then renamed; the format named, as the temporary name's suffix names none
    write_atomically(Path(path), lambda tmp: fig.savefig(tmp, dpi=120,
                                                         format=Path(path).suffix[1:] or "png"))
