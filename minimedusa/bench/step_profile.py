"""Where a decoding step's time goes: `python -m minimedusa.bench --profile`.

torch.profiler over a few plain and Medusa steps from one prompt, operators by their own time and
split by input shape, so that a tree step's extra cost shows operator by operator; then what a
forward and its products alone cost at each number of rows (a tree of n nodes runs n + 1), and
a whole step at each tree size against a plain one.
"""
import functools
import time
from dataclasses import replace
from pathlib import Path

import torch

from minimedusa.budget import grow_tree, nested_trees
from minimedusa.assembly.recipe import Recipe, build, decoding_heads, timed_parts
from minimedusa.files.heads_files import read_calibration
from minimedusa.assembly.step_latency import (cached_prefix, round_robin_medians, step_latency,
                                          time_forward)
from minimedusa.heads import as_features, ranked_vocab_size
from minimedusa.kv_cache import KVCache
from minimedusa.speed.group_kernel import switch_tiles, switch_vnni, uses_tiles, uses_vnni
from minimedusa.speed.memory_bandwidth import module_bytes, streaming_bandwidth
from minimedusa.speed.defaults import largest_grown_tree
from minimedusa.speed.packed_linear import PackedLinear
from minimedusa.speed.quantized import Int4KernelLinear, Int4Linear, Int8GroupLinear, Int8Linear
from minimedusa.speed.weight_formats import weight_format


def profile_steps(recipe: Recipe, model, heads, prompt_ids: list[int], steps: int = 8) -> str:
    """Where one step's time goes: torch.profiler over a few plain and Medusa steps from the
    same prompt (its prefill left out), operators sorted by their own time and split by input
    shape, so the LM head's products show apart from the blocks'. recipe: Medusa's (its heads
    `heads`, its tree: --tree's, else the Budget's), built beside plain decoding's."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    plain, medusa = build(replace(recipe, heads=None), model), build(recipe, model, heads)
    tables = []
    for name, decoding, n in (("plain", plain, steps + 1),
                              ("medusa greedy", medusa,
                               steps * (heads.config.medusa_num_heads + 1))):
        def decode():
            return decoding.decode(prompt_ids, n, set())
        for _ in decode():  # warm-up
            pass
        forwards = decode()
        next(forwards)  # the prefill, not a step
        with profile(activities=activities, record_shapes=True) as prof:
            start = time.perf_counter()
            count = sum(1 for _ in forwards)  # each item: one step's accepted tokens
            seconds = time.perf_counter() - start
        tables.append(f"{name}: {count} steps in {1000 * seconds:.0f} ms, "
                      f"{1000 * seconds / count:.1f} ms a step (profiler on)\n"
                      + prof.key_averages(group_by_input_shape=True).table(
                          sort_by="self_cpu_time_total", row_limit=12))
    return "\n".join(tables)


ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17)  # a plain step, small trees, the 8- and 16-node trees
LARGE = (32, 64)  # the larger trees the Budget grows where rows are cheap (a GPU's)


def large_sizes(device: torch.device) -> tuple[int, ...]:
    """The tree sizes beyond 16 nodes this device's Budget may choose (none on a CPU)."""
    return tuple(n for n in LARGE if n <= largest_grown_tree(device))


# the layers a weight format swaps in
FAST_LAYERS = (PackedLinear, Int4Linear, Int4KernelLinear, Int8GroupLinear, Int8Linear)


# group_kernel.c's two ways of multiplying a format's rows, where this process has the first:
# the switch that picks one, and whether it picks the first
PATHS = {"AMX tiles": (switch_tiles, True), "dot products": (switch_tiles, False),
         "VNNI": (switch_vnni, True), "AVX2 code": (switch_vnni, False)}


# whether this process has a format's first path (its row_paths' first)
USES = {"AMX tiles": uses_tiles, "VNNI": uses_vnni}


def kernel_paths(model) -> tuple[str, ...]:
    """The paths product_times compares side by side (the format's row_paths): AMX tiles
    against AVX-512 BF16's dot products (int4's bfloat16 rows), AVX-512 VNNI against the AVX2
    code (w4a8's quantized rows) where this process uses the first; else one, unnamed."""
    paths = weight_format(model).row_paths
    return paths if paths and USES[paths[0]]() else ("",)


@torch.inference_mode()
def product_times(model, rows=ROWS, rounds: int = 5) -> str:
    """The blocks' products and the LM head at each number of rows M, as the format's layers run
    them (prepacked ones without their padding to MIN_ROWS), in ms and the GB/s of weights
    that implies; medians, the row counts taking turns (budget.round_robin_medians). Where
    group_kernel.c has two paths for the format's rows (kernel_paths), both, taking turns: what
    the faster one saves, side by side."""
    blocks = [m for m in model.layers.modules() if isinstance(m, FAST_LAYERS)]
    if not blocks or not isinstance(model.lm_head, FAST_LAYERS):
        return "products: this model's layers are not a CPU format's (weight_formats.py): not timed"
    parts = {"blocks": blocks, "LM head": [model.lm_head]}
    gigabytes = {name: module_bytes(*layers) / 1e9 for name, layers in parts.items()}
    dtype = model.norm.weight.dtype  # the activations' (float32 where int4's kernel takes it)
    paths = kernel_paths(model)
    try:
        seconds = round_robin_medians(
            {(name, M, path): functools.partial(time_products, layers, M, dtype, path)
             for M in rows for name, layers in parts.items() for path in paths}, rounds)
    finally:
        use_path(paths[0])  # the first path back on, as the process had it
    lines = []
    for path in paths:
        lines.append("products alone, ms (GB/s of weights): M rows, the blocks' and the LM "
                     f"head's{', ' + path if path else ''}")
        for M in rows:
            lines.append(f"  M = {M:2d}: " + ", ".join(
                f"{name} {1000 * seconds[name, M, path]:.1f} "
                f"({gigabytes[name] / seconds[name, M, path]:.1f})" for name in parts))
    return "\n".join(lines)


@torch.inference_mode()
def shape_times(model, rounds: int = 5) -> str:
    """A plain step's products by shape (the blocks' wqkv, wo, gate_up and down, each summed over
    the blocks, and the LM head), one row each, on both threads and on one: ms, the GB/s of
    weights that implies, and what the second thread gains (x); then what the step's forward
    spends beside them (attention, norms, the rest), and the machine's streaming read rate. A
    profile of where a model of real size's step goes, for the record (model_size --profile)."""
    parts: dict[str, list] = {}
    for block in model.layers:
        for name, layer in block.named_modules():
            if isinstance(layer, FAST_LAYERS):
                parts.setdefault(f"{name.rsplit('.', 1)[-1]} {layer.in_features}->"
                                 f"{layer.out_features}", []).append(layer)
    parts[f"LM head {model.lm_head.in_features}->{model.lm_head.out_features}"] = [model.lm_head]
    dtype, threads = model.norm.weight.dtype, torch.get_num_threads()
    seconds = {}
    for n in (threads, 1):
        torch.set_num_threads(n)
        seconds[n] = round_robin_medians({name: functools.partial(time_products, layers, 1, dtype)
                                          for name, layers in parts.items()}, rounds)
    torch.set_num_threads(threads)
    lines = [f"products at 1 row, ms on {threads} threads (GB/s of weights; x: {threads} threads"
             " against 1):"]
    for name, layers in parts.items():
        ms, gb = 1000 * seconds[threads][name], module_bytes(*layers) / 1e9
        lines.append(f"  {name}: {ms:.2f} ({gb / seconds[threads][name]:.1f} GB/s; "
                     f"{seconds[1][name] / seconds[threads][name]:.2f}x)")
    forward = forward_ms_at_one_row(model)
    products = 1000 * sum(seconds[threads].values())
    lines.append(f"a forward of 1 row after 256 cached tokens: {forward:.1f} ms; its products "
                 f"called one by one above: {products:.1f} ms, the rest (attention, norms, ...) "
                 f"{forward - products:.1f} (a fused step calls them from C++: where the rest is "
                 "below 0, Python's calls cost more than the rest)")
    read = streaming_bandwidth(model.embed.weight.device)["read_gb_s"]
    lines.append(f"this machine streams {read:.1f} GB/s read alone (memory_bandwidth.py)")
    return "\n".join(lines)


def forward_ms_at_one_row(model, cached: int = 256) -> float:
    """The median ms of a forward of 1 row after `cached` tokens."""
    cache = KVCache.for_model(model, cached + 1)
    return 1000 * round_robin_medians({1: functools.partial(time_forward, model, cache, cached,
                                                            1)}, 9)[1]


def use_path(path: str) -> None:
    """Switch group_kernel.c to a path of PATHS; "" (one path) changes nothing."""
    if path:
        switch, on = PATHS[path]
        switch(on)


def time_products(layers, M: int, dtype: torch.dtype, path: str = "") -> float:
    """Seconds to multiply M random rows (of `dtype`, a prepacked layer's own) by each layer's
    weight, one after another, on `path` (use_path)."""
    use_path(path)
    inputs = [torch.randn(M, m.in_features, dtype=m.dtype if isinstance(m, PackedLinear)
                          else dtype) for m in layers]
    start = time.perf_counter()
    for layer, x in zip(layers, inputs):
        layer.product(x) if isinstance(layer, PackedLinear) else layer(x)  # (M, O)
    return time.perf_counter() - start


# tree sizes whose steps step_times times: rows = nodes + 1, so 7 and 15 nodes are 8- and
# 16-row steps, the multiples of 4 rows int4's kernel reads its weights once per
STEP_SIZES = (1, 2, 3, 4, 7, 8, 15, 16)


def grown_trees(model, heads, accuracy) -> dict:
    """{n: the tree of the n most probable nodes} for each of STEP_SIZES (and the device's
    large_sizes) the heads grow to."""
    step_sizes = STEP_SIZES + large_sizes(model.embed.weight.device)
    nodes, _ = grow_tree(accuracy, max(step_sizes))
    sizes = [n for n in step_sizes if n <= len(nodes)]  # few heads and ranks: few nodes
    trees, _ = nested_trees(nodes, sizes, heads.config.medusa_num_heads,
                            ranked_vocab_size(heads, model), model.embed.weight.device)
    return trees


def step_times(recipe: Recipe, model, heads, accuracy, cached: int = 256) -> str:
    """A whole step at each tree size, as the Budget times it (step_latency: the recipe's
    draft, the tree's forward, its acceptance and compaction, after `cached` tokens: fewer for
    a model whose context is short), against a plain step: what a tree of n nodes costs on this
    machine, in this format."""
    trees = grown_trees(model, heads, accuracy)
    seconds = step_latency(model, *timed_parts(recipe, heads, trees, model), list(trees), cached)
    return (f"a whole step after {cached_prefix(model, cached)} cached tokens, ms (x a plain "
            "step): plain "
            f"{1000 * seconds[0]:.1f}, " + ", ".join(
                f"{n} nodes ({n + 1} rows) {1000 * seconds[n]:.1f} ({seconds[n] / seconds[0]:.2f}x)"
                for n in trees))


@torch.inference_mode()
def forward_times(model, rows=None, cached: int = 256, rounds: int = 5) -> str:
    """The model's forward of M new rows after `cached` tokens, for each M (ms, medians, the row
    counts taking turns): what a tree's extra rows cost, products and all. rows: ROWS and the
    device's large trees' (n + 1), unless given."""
    if rows is None:
        rows = ROWS + tuple(n + 1 for n in large_sizes(model.embed.weight.device))
    cache = KVCache.for_model(model, cached + max(rows))
    seconds = round_robin_medians({M: functools.partial(time_forward, model, cache, cached, M)
                                   for M in rows}, rounds)
    return (f"a forward of M rows after {cached} cached tokens, ms: " +
            ", ".join(f"M = {M} {1000 * t:.1f}" for M, t in seconds.items()))


@torch.inference_mode()
def draft_times(recipe: Recipe, model, heads, accuracy, rounds: int = 9) -> str:
    """The heads' draft alone at each tree size: the part of a whole step (step_times) that is
    not the model's forward, beside acceptance and compaction. Medusa heads guess every depth in
    one call; Hydra heads run depth by depth, so their draft grows with the tree's depth."""
    trees = grown_trees(model, heads, accuracy)
    draft, _ = timed_parts(recipe, heads, trees, model)  # as decoding drafts (fused, or not)
    features = as_features(heads, torch.randn(model.config.hidden_size,
                                               device=model.embed.weight.device))  # (C,)
    seconds = round_robin_medians({n: functools.partial(time_draft, model, draft, n, features)
                                   for n in trees}, rounds)
    return ("the heads' draft alone, ms (its depths): " + ", ".join(
        f"{n} nodes {1000 * seconds[n]:.2f} ({tree.depth.max().item()})"
        for n, tree in trees.items()))


def time_draft(model, draft, n: int, features) -> float:
    """Seconds of one draft of the n-node tree's tokens from the features at one position."""
    start = time.perf_counter()
    draft.tree(model, n, 0, features).tokens.tolist()  # on the host: the draft is done
    return time.perf_counter() - start


def report_profile(args, recipe: Recipe, model, tokenizer, question: dict) -> None:
    """bench --profile: where a step's time goes (profile_steps) on the question, with the
    first --heads (their tree: --tree's, else the Budget's), then what forwards, products, whole
    steps and the draft cost at each size."""
    medusa = replace(recipe, heads=args.heads[0], draft_vocab=args.draft_vocab[0],
                     tree=args.tree)
    heads = decoding_heads(medusa.heads, model, medusa.draft_vocab)
    prompt = [{"role": "user", "content": question["prompt"]}]
    print(profile_steps(medusa, model, heads, tokenizer.encode(tokenizer.chat_prompt(prompt))))
    print(forward_times(model))
    print(forward_times(model, cached=1536))  # how a row's cost grows with the context
    print(product_times(model))
    accuracy = read_calibration(Path(medusa.heads)) if Path(medusa.heads).is_dir() else None
    if accuracy is None:
        print("steps by tree size: the heads have no calibration.json to grow trees from")
        return
    for cached in (256, 1536):  # how a row's cost grows with the context
        print(step_times(medusa, model, heads, accuracy, cached))
    print(draft_times(medusa, model, heads, accuracy))
