"""The benchmark's engines: everything `bench` times, each a function
(prompt ids, n new tokens, seed) -> (token ids, seconds, steps).

This project's plain decoding and Medusa (greedy, typical, rejection and speculative sampling;
the tree's size adapted step by step as generate.py does, or a fixed --tree, or --sizes' and
--ranked's trees), the same in other weight formats (--formats): each engine a recipe
(assembly/recipe.py) built on the loaded model, engines differing in a field of it; and two
baselines from outside, each optional: the transformers library's `generate` on the same
weights and llama.cpp on the GGUF file the
default model came from (llama_cpp.py).
"""
import copy
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from minimedusa.bench.llama_cpp_tools import llama_cpp_engines
from minimedusa.budget import expected_length, expected_length_of, grow_tree
from minimedusa.cli.show import origins as token_origins
from minimedusa.assembly.recipe import Recipe, build, decoding_heads, decoding_model
from minimedusa.assembly.trees import decoding_tree
from minimedusa.errors import UserError
from minimedusa.files.heads_files import read_calibration
from minimedusa.heads import ranked_vocab_size
from minimedusa.speed.memory_bandwidth import module_bytes
from minimedusa.speed.plug_in import eager_step
from minimedusa.speed.weight_formats import format_named


EAGER = " (eager)"  # the name's suffix of an engine timed with the decoding step eager
NO_CONTEXT = " (no context)"  # ... of a Medusa engine without context candidates


@dataclass
class Engines:
    """What `bench` times, and what it knows of each engine beforehand."""
    run: dict = field(default_factory=dict)  # name -> engine
    expected: dict = field(default_factory=dict)  # name -> tokens/step from the calibration
    usage: dict = field(default_factory=dict)  # name -> Counter of steps by tree size
    # name -> Counter of tokens by what guessed them (cli/show.origins: head k, "context",
    # "draft", or "model", the verifier's own token): Medusa is its heads, and this tells how
    # much of a step's gain the heads supply and how much the context candidates
    origins: dict = field(default_factory=dict)
    step_bytes: dict = field(default_factory=dict)  # name -> bytes of weights a step reads

    def drop(self, name: str) -> None:
        """Out of the comparison (an engine whose process died), wherever it is named."""
        for table in (self.run, self.expected, self.usage, self.origins, self.step_bytes):
            table.pop(name, None)


def engines_to_time(args, recipe: Recipe, model, tokenizer) -> Engines:
    """Plain decoding and the Medusa engines of `recipe` (the --dtype / --quantize format, the
    model loaded from it), the same in each of --formats, and, where they are installed,
    transformers' generate and llama.cpp (its own llama-completion, its Python binding)."""
    engines = Engines()
    engines.run["plain"], engines.step_bytes["plain"] = engine(recipe, model), module_bytes(model)
    if args.temperature > 0:  # what the sampling engines speed up
        name = f"plain T={args.temperature}"
        engines.run[name] = engine(replace(recipe, temperature=args.temperature), model)
        engines.step_bytes[name] = module_bytes(model)
    if args.eager_too:
        engines.run["plain" + EAGER] = eager_engine(engines.run["plain"], model)
        engines.step_bytes["plain" + EAGER] = engines.step_bytes["plain"]
    medusa_engines(args, recipe, model, engines)
    for name in args.formats:
        format_engines(args, replace(recipe, weight_format=format_named(name)), engines)
    hf = (None if args.no_transformers else
          load_transformers(recipe.folder, recipe.device, model.embed.weight.dtype))
    if hf is not None:
        engines.run["transformers"] = transformers_engine(hf)
    elif not args.no_transformers:
        print("transformers is not installed: it is left out of the comparison "
              "(pip install transformers, in a scratch environment, to compare)", file=sys.stderr)
    engines.run |= llama_cpp_engines(args, recipe.folder, torch.get_num_threads(), tokenizer)
    return engines


def format_engines(args, recipe: Recipe, engines: Engines) -> None:
    """--formats: plain decoding and Medusa greedy with the first --heads (the tree as the other
    engines pick it) with the model in the recipe's weight format, as "[name] plain" and so on."""
    model, step = decoding_model(recipe)
    print(f"[{recipe.weight_format.name}] decoding step: {step}", file=sys.stderr)
    heads = decoding_heads(args.heads[0], model)
    label = f"[{recipe.weight_format.name}] "
    plain = {label + "plain": engine(recipe, model)}
    if args.eager_too:
        plain[label + "plain" + EAGER] = eager_engine(plain[label + "plain"], model)
    engines.run.update(plain)
    engines.step_bytes.update({n: module_bytes(model) for n in plain})
    medusa = rule_engines(f"{label}{heads.config.head_kind} ", medusa_recipe(args, recipe,
                                                                             args.heads[0]),
                          model, heads, 0.0, engines.usage, engines.origins, args.eager_too,
                          args.context)
    engines.run.update(medusa)
    engines.step_bytes.update({n: module_bytes(model, heads) for n in medusa})


def medusa_recipe(args, recipe: Recipe, spec: str, vocab: int | None = None) -> Recipe:
    """Medusa greedy with the heads `spec` as --tree and --context ask (context candidates with
    the adapted trees only, as generate.py)."""
    return replace(recipe, heads=spec, draft_vocab=vocab, tree=args.tree,
                   context=args.context != "off" and args.tree is None)


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


def timed(steps, origins: Counter | None = None) -> tuple[list[int], float, int]:
    """Drain a decoding iterator: (tokens, seconds, steps); each token's origin counted into
    `origins` as the step comes (microseconds a step, inside the clock; keeping the steps for
    later would hold every step's draft distributions, on the GPU where it decodes)."""
    start, out, n = time.perf_counter(), [], 0
    for step in steps:
        out += step.tokens
        n += 1
        if origins is not None:
            origins.update(token_origins(step))
    return out, time.perf_counter() - start, n


def engine(recipe: Recipe, model, heads=None, usage: Counter | None = None, drafter=None,
           origins: Counter | None = None):
    """The recipe's decoding (recipe.build: its heads or draft model's draft, trees, budget and
    rule; drafter: the draft model, loaded already) as an engine: each question from a fresh
    copy of the budget (its priors, as each generate.py process starts), the rule seeded by the
    question (each engine's sampling draws repeat question by question); the steps run at each
    size go to `usage`, the tokens by origin to `origins`."""
    decoding = build(recipe, model, heads, drafter)

    def run(ids, n, seed):
        seeded = decoding.seeded(seed)
        if decoding.draft is not None:
            seeded = replace(seeded, budget=copy.deepcopy(decoding.budget))
        result = timed(seeded.decode(ids, n, set()), origins)
        if usage is not None and seeded.budget is not None:
            usage.update(seeded.budget.used)
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


def rule_engines(label, recipe: Recipe, model, heads, temperature: float, usage: dict,
                 origins: dict, eager_too: bool = False, context: str = "on") -> dict:
    """Greedy, and at a temperature typical, rejection and speculative sampling (of drawn
    candidates: generate.py's default above temperature 0), each the recipe with its rule: on
    the recipe's --tree every step, or the tree's size adapted (usage[name]: the steps at each
    size) with context candidates as `context` says (on, off, or both: every rule again
    without); origins[name]: the tokens by what guessed them; with `eager_too`, greedy again
    with the decoding step eager."""
    T = temperature
    rules = {"greedy": recipe}
    if T > 0:
        rules |= {f"{rule} T={T}": replace(recipe, acceptance=rule, temperature=T)
                  for rule in ("typical", "rejection", "speculative")}
    if recipe.tree is None and context == "both":
        rules |= {r + NO_CONTEXT: replace(rule, context=False) for r, rule in rules.items()}
    if recipe.tree is None:
        usage.update({label + r: Counter() for r in rules})
    origins.update({label + r: Counter() for r in rules})
    run = {label + r: engine(rule, model, heads, usage.get(label + r),
                             origins=origins[label + r])
           for r, rule in rules.items()}
    if eager_too:
        run[label + "greedy" + EAGER] = eager_engine(engine(recipe, model, heads), model)
    return run


def medusa_engines(args, recipe: Recipe, model, engines: Engines) -> None:
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
            heads_engines(engines, label, medusa_recipe(args, recipe, spec, vocab), heads,
                          model, args)
            engines.step_bytes.update({n: module_bytes(model, heads)
                                       for n in engines.run if n not in before})


def heads_engines(engines: Engines, label, recipe: Recipe, heads, model, args) -> None:
    """One heads' engines (the acceptance rules, --sizes' grown trees, --ranked's), into
    engines: each the recipe with a field changed."""
    accuracy = read_calibration(Path(recipe.heads)) if Path(recipe.heads).is_dir() else None
    run, expected, usage = engines.run, engines.expected, engines.usage
    if args.tree is not None:
        tree_name, tree = decoding_tree(args.tree, heads, model)
        print(f"{label.strip()}: tree {tree_name} ({tree.size - 1} nodes)", file=sys.stderr)
        if accuracy is not None:
            expected[label + "greedy"] = expected_length_of(tree.nodes[1:], accuracy)
    run.update(rule_engines(label, recipe, model, heads, args.temperature, usage,
                            engines.origins, args.eager_too, args.context))
    if args.sizes:
        if accuracy is None:
            raise UserError(f"--sizes grows trees from {recipe.heads}/calibration.json, "
                            "which does not exist (run python -m minimedusa.training.tree_search)")
        _, probs = grow_tree(accuracy, max(args.sizes))
        for n in args.sizes:  # with context candidates as --context says
            for context in {"on": (True,), "off": (False,), "both": (True, False)}[args.context]:
                name = label + f"greedy {n} nodes" + ("" if context else NO_CONTEXT)
                run[name] = engine(replace(recipe, tree=f"grown:{n}", context=context), model,
                                   heads)
                expected[name] = expected_length(probs[:n])
    for n in args.ranked:
        run[label + f"greedy ranked {n} nodes"] = engine(
            replace(recipe, tree=f"ranked:{n}", context=False), model, heads)
    if args.ranked_adapted:
        usage[label + "greedy ranked"] = Counter()
        run[label + "greedy ranked"] = engine(replace(recipe, tree="ranked", context=False),
                                              model, heads, usage[label + "greedy ranked"])
