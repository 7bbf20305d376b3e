"""The benchmark's engines: everything `bench` times, each a function
(prompt ids, n new tokens, seed) -> (token ids, seconds, steps).

This project's plain decoding and Medusa (greedy, typical and rejection sampling; the tree's size
adapted step by step as generate.py does, or a fixed --tree, or --sizes' and --ranked's trees),
the same in other weight formats (--formats), and two baselines from outside, each optional:
the transformers library's `generate` on the same weights and llama.cpp on the GGUF file the
default model came from (llama_cpp.py).
"""
import copy
import dataclasses
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minimedusa.acceptance import rejection, typical
from minimedusa.bench.llama_cpp_tools import llama_cpp_engines
from minimedusa.budget import (FixedSize, expected_length, expected_length_of, fixed, grow_tree,
                               nested_trees)
from minimedusa.files.heads_files import read_calibration
from minimedusa.cli.draft_heads import decoding_heads
from minimedusa.cli.drafts import wrapped
from minimedusa.cli.load import decoding_model
from minimedusa.cli.trees import decoding_budget, decoding_tree
from minimedusa.heads import ranked_vocab_size
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.draft import RankedDraft, TreeDraft
from minimedusa.speed.fused_draft import fast_draft
from minimedusa.speed.plug_in import eager_step
from minimedusa.errors import UserError
from minimedusa.speed.memory_bandwidth import weight_bytes
from minimedusa.speculative_sampling import DrawnDraft, speculative
from minimedusa.speed.host_greedy import greedy_for, sampling_for


EAGER = " (eager)"  # the name's suffix of an engine timed with the decoding step eager
NO_CONTEXT = " (no context)"  # ... of a Medusa engine without context candidates


@dataclass
class Engines:
    """What `bench` times, and what it knows of each engine beforehand."""
    run: dict = field(default_factory=dict)  # name -> engine
    expected: dict = field(default_factory=dict)  # name -> tokens/step from the calibration
    usage: dict = field(default_factory=dict)  # name -> Counter of steps by tree size
    step_bytes: dict = field(default_factory=dict)  # name -> bytes of weights a step reads

    def drop(self, name: str) -> None:
        """Out of the comparison (an engine whose process died), wherever it is named."""
        for table in (self.run, self.expected, self.usage, self.step_bytes):
            table.pop(name, None)


def engines_to_time(args, model, folder: Path, device, dtype, tokenizer) -> Engines:
    """Plain decoding and the Medusa engines in the --dtype / --quantize format, the same in
    each of --formats, and, where they are installed, transformers' generate and llama.cpp
    (its own llama-completion, its Python binding)."""
    engines = Engines()
    engines.run["plain"], engines.step_bytes["plain"] = plain_engine(model), weight_bytes(model)
    if args.temperature > 0:  # what the sampling engines speed up
        name = f"plain T={args.temperature}"
        engines.run[name], engines.step_bytes[name] = (plain_engine(model, args.temperature),
                                                       weight_bytes(model))
    if args.eager_too:
        engines.run["plain" + EAGER] = eager_engine(engines.run["plain"], model)
        engines.step_bytes["plain" + EAGER] = engines.step_bytes["plain"]
    medusa_engines(args, model, device, engines)
    for name in args.formats:
        format_engines(args, folder, device, name, engines)
    hf = None if args.no_transformers else load_transformers(folder, device, dtype)
    if hf is not None:
        engines.run["transformers"] = transformers_engine(hf)
    elif not args.no_transformers:
        print("transformers is not installed: it is left out of the comparison "
              "(pip install transformers, in a scratch environment, to compare)", file=sys.stderr)
    engines.run |= llama_cpp_engines(args, folder, torch.get_num_threads(), tokenizer)
    return engines


def format_engines(args, folder: Path, device, name: str, engines: Engines) -> None:
    """--formats: plain decoding and Medusa greedy with the first --heads (the tree as the other
    engines pick it) with the model in weight format `name`, as "[name] plain" and so on."""
    model, step = decoding_model(folder, device, name, args.compile)
    print(f"[{name}] decoding step: {step}", file=sys.stderr)
    heads = decoding_heads(args.heads[0], model)
    tree = None if args.tree is None else decoding_tree(args.tree, heads, model)[1]
    label = f"[{name}] "
    plain = {label + "plain": plain_engine(model)}
    if args.eager_too:
        plain[label + "plain" + EAGER] = eager_engine(plain[label + "plain"], model)
    engines.run.update(plain)
    engines.step_bytes.update({n: weight_bytes(model) for n in plain})
    medusa = rule_engines(f"{label}{heads.config.head_kind} ", args.heads[0], model, heads, tree,
                          0.0, engines.usage, args.eager_too, args.context)
    engines.run.update(medusa)
    engines.step_bytes.update({n: weight_bytes(model, heads) for n in medusa})


def plain_of(name: str) -> str:
    """The engine whose output `name`'s must equal: plain decoding in its own weight format,
    eager if `name` is (compiled and eager steps round differently: each is its own greedy)."""
    if name.endswith(EAGER):
        return plain_of(name.removesuffix(EAGER)) + EAGER
    return name[:name.index("] ") + 2] + "plain" if name.startswith("[") else "plain"


def eager_engine(run, model):
    """The same engine with the model's decoding step eager, even if it is compiled or in CUDA
    graphs."""
    def eager_run(ids, n, seed):
        with eager_step(model):
            return run(ids, n, seed)
    return eager_run


def timed(steps) -> tuple[list[int], float, int]:
    """Drain a decoding iterator: (tokens, seconds, steps)."""
    start, out, n = time.perf_counter(), [], 0
    for step in steps:
        out += step
        n += 1
    return out, time.perf_counter() - start, n


def plain_engine(model, temperature: float = 0.0):
    """Plain decoding, greedy or (temperature > 0) sampling, seeded by the question."""
    def run(ids, n, seed):
        sampling = sampling_for(model.embed.weight.device, temperature, 1.0, seed)
        return timed(plain_decode(model, ids, n, sampling, set()))
    return run


def seeded(acceptance, seed):
    """The rule with the question's seed: each engine's sampling draws repeat question by
    question."""
    return dataclasses.replace(acceptance, seed=seed)


def fixed_engine(model, draft, budget, acceptance):
    """Medusa with a draft and a budget kept from question to question (one tree size)."""
    return lambda ids, n, seed: timed(medusa_decode(model, draft, budget, seeded(acceptance, seed),
                                                    ids, n, set()))


def medusa_engine(model, heads, tree, acceptance, context=False):
    draft, budget = fixed(heads, tree)
    return fixed_engine(model, wrapped(fast_draft(draft, model), heads, context), budget,
                        acceptance)


def drawn_engine(model, heads, tree, temperature: float):
    """Speculative sampling of candidates drawn from the heads, on one tree every step."""
    draft, budget = fixed(heads, tree)
    drawn = fast_draft(DrawnDraft(heads, draft.trees, temperature), model)
    return fixed_engine(model, drawn, budget, speculative(temperature))


def adaptive_engine(model, draft, budget, acceptance, usage: Counter):
    """Medusa with the tree's size adapted step by step, as generate.py decodes by default (its
    draft: as --tree ranked does with a RankedDraft, with context candidates in a ContextDraft):
    each question starts from the same prior (a fresh copy of `budget`), as each generate.py
    process does; the steps run at each size go to `usage`."""
    def run(ids, n, seed):
        fresh = copy.deepcopy(budget)
        result = timed(medusa_decode(model, draft, fresh, seeded(acceptance, seed), ids, n,
                                     set()))
        usage.update(fresh.used)
        return result
    return run


def load_transformers(folder: Path, device, dtype):
    """transformers' Llama on the same converted weights, or None if it is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    # local_files_only: the folder is this project's converted model; never ask a hub
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True) \
        .to(device).eval()


def transformers_engine(hf_model):
    def run(prompt_ids: list[int], n: int, seed):
        ids = torch.tensor([prompt_ids], device=hf_model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        return out[0, len(prompt_ids):].tolist(), time.perf_counter() - start, n
    return run


def rule_engines(label, spec, model, heads, tree, temperature: float, usage: dict,
                 eager_too: bool = False, context: str = "on") -> dict:
    """Greedy, and at a temperature typical and rejection sampling: with `tree` (the --tree)
    for every step, or without one with the tree's size adapted (usage[name]: the steps at each
    size) and context candidates as `context` says (on, off, or both: greedy again without),
    and then speculative sampling of drawn candidates too (generate.py's default above
    temperature 0); with `eager_too`, greedy again with the decoding step eager."""
    rules = {"greedy": greedy_for(model.embed.weight.device)}
    if temperature > 0:
        T = temperature
        rules.update({f"typical T={T}": typical(T), f"rejection T={T}": rejection(T)})
    if tree is not None:
        run = {label + r: medusa_engine(model, heads, tree, a) for r, a in rules.items()}
        if temperature > 0:
            run[label + f"speculative T={temperature}"] = drawn_engine(model, heads, tree,
                                                                       temperature)
        if eager_too:
            run[label + "greedy" + EAGER] = eager_engine(medusa_engine(model, heads, tree,
                                                                       rules["greedy"]), model)
        return run
    trees, budget, why = decoding_budget(heads, model, spec, context != "off")
    print(f"{label.strip()}: tree sizes {list(trees)} or plain, {why}", file=sys.stderr)
    if eager_too:
        rules["greedy" + EAGER] = rules["greedy"]
    if context == "both":
        rules["greedy" + NO_CONTEXT] = rules["greedy"]
    usage.update({label + r: Counter() for r in rules})
    drafts = dict.fromkeys(rules, fast_draft(TreeDraft(heads, trees), model))  # stateless
    if temperature > 0:
        name = f"speculative T={temperature}"
        drafts[name] = fast_draft(DrawnDraft(heads, trees, temperature), model)
        rules[name] = speculative(temperature)
        usage[label + name] = Counter()
    run = {label + r: adaptive_engine(model, wrapped(drafts[r], heads, context != "off" and not
                                                     r.endswith(NO_CONTEXT)), budget, a,
                                      usage[label + r])
           for r, a in rules.items()}
    if eager_too:
        run[label + "greedy" + EAGER] = eager_engine(run[label + "greedy" + EAGER], model)
    return run


def medusa_engines(args, model, device, engines: Engines) -> None:
    """For every --heads, and for each of them every --draft-vocab, its engines (with what
    they are expected to accept, from the heads' calibration, where there is one)."""
    for spec in args.heads:
        for vocab in args.draft_vocab:
            heads = decoding_heads(spec, model, vocab)
            label = (f"{heads.config.head_kind} {Path(spec).name} " if len(args.heads) > 1
                     else f"{heads.config.head_kind} ")
            if len(args.draft_vocab) > 1:
                label += f"V'={ranked_vocab_size(heads, model)} "
            before = set(engines.run)
            heads_engines(engines, label, spec, heads, model, device, args)
            engines.step_bytes.update({n: weight_bytes(model, heads)
                                       for n in engines.run if n not in before})


def heads_engines(engines: Engines, label, spec, heads, model, device, args) -> None:
    """One heads' engines (the acceptance rules, and --sizes' fixed trees), into engines."""
    accuracy = read_calibration(Path(spec)) if Path(spec).is_dir() else None
    run, expected, usage = engines.run, engines.expected, engines.usage
    tree = None
    if args.tree is not None:
        tree_name, tree = decoding_tree(args.tree, heads, model)
        print(f"{label.strip()}: tree {tree_name} ({tree.size - 1} nodes)", file=sys.stderr)
        if accuracy is not None:
            expected[label + "greedy"] = expected_length_of(tree.nodes[1:], accuracy)
    run.update(rule_engines(label, spec, model, heads, tree, args.temperature, usage,
                            args.eager_too, args.context))
    if args.sizes:
        if accuracy is None:
            raise UserError(f"--sizes grows trees from {spec}/calibration.json, "
                            "which does not exist (run python -m minimedusa.training.tree_search)")
        nodes, probs = grow_tree(accuracy, max(args.sizes))
        trees, _ = nested_trees(nodes, args.sizes, heads.config.medusa_num_heads,
                                ranked_vocab_size(heads, model), device)
        for n, sized in trees.items():  # with context candidates as --context says
            for context in {"on": (True,), "off": (False,), "both": (True, False)}[args.context]:
                name = label + f"greedy {n} nodes" + ("" if context else NO_CONTEXT)
                run[name] = medusa_engine(model, heads, sized, greedy_for(device), context)
                expected[name] = expected_length(probs[:n])
    for n in args.ranked:
        run[label + f"greedy ranked {n} nodes"] = ranked_engine(model, heads, n)
    if args.ranked_adapted:
        _, budget, _ = decoding_budget(heads, model, spec)
        usage[label + "greedy ranked"] = Counter()
        run[label + "greedy ranked"] = adaptive_engine(model, wrapped(RankedDraft(heads), heads,
                                                                      False), budget,
                                                       greedy_for(device),
                                                       usage[label + "greedy ranked"])


def ranked_engine(model, heads, size: int):
    return fixed_engine(model, wrapped(RankedDraft(heads), heads, False), FixedSize(size),
                        greedy_for(model.embed.weight.device))


