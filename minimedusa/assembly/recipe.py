"""One recipe from flags to a decoder. What generate.py, bench (every engine), the step-latency
timing and the training tools decode with is a Recipe: the model's folder, device and weight
format, how its step runs (--compile), the heads, their tree, context candidates and the
acceptance rule. decoding_model reads the model as the recipe says; build() turns the recipe, on
that model, into the decoding loop's parts: plain decoding's Sampling, or the draft, budget and
acceptance of decoding.medusa_decode, whose trees' step latencies are timed with that very draft
and acceptance (step_latency.py). Two engines differ in a field, never in a second assembly.

Speed is plugged in here and nowhere else outside speed/ (tests/test_wings.py): the model's
layers and step (plug_in) and the check of that step against the eager one (checked_step), the
heads in the model's format (plug_in_heads), their draft fused (fast_draft), greedy walked on
the host on a CPU (greedy_for, sampling_for). Each object is built as the core defines it, and
its speed swapped in after.
"""
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from minimedusa import acceptance, experiments
from minimedusa.acceptance import Acceptance, Sampling
from minimedusa.budget import Budget, FixedSize
from minimedusa.assembly.heads_reading import read_heads
from minimedusa.assembly.draft_model import (DRAFT_SIZES, check_draft, draft_format,
                                             expected_tokens)
from minimedusa.assembly.latency_cache import machine_latency
from minimedusa.assembly.load import formatted_model, machine_format
from minimedusa.assembly.trees import budget_trees, decoding_tree, tree_spec
from minimedusa.context_candidates import ContextDraft
from minimedusa.decoding import medusa_decode, plain_decode
from minimedusa.draft import RankedDraft, TreeDraft
from minimedusa.errors import UserError
from minimedusa.experiments.draft_layer import HydraPlusPlusHeads, PlusPlusDraft
from minimedusa.heads import ranked_vocab_size
from minimedusa.model import Llama
from minimedusa.speculative_decoding import DraftModelWithHeads, ModelDraft
from minimedusa.speculative_sampling import DrawnDraft, speculative
from minimedusa.speed.fused_draft import fast_draft
from minimedusa.speed.host_greedy import greedy_for, sampling_for
from minimedusa.speed.plug_in import plug_in, plug_in_heads
from minimedusa.speed.reference_check import checked_step


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Everything that decides what a run decodes with (dataclasses.replace makes a variant),
    named field by field where it is made: sixteen in a row would be read by position."""
    folder: Path  # the model's
    device: torch.device
    weight_format: object  # weight_formats.py's FLOAT32, BFLOAT16, INT8, INT4, W4A8 (FORMATS)
    compile: bool | None = None  # --compile: None the machine's faster step, False eager
    heads: str | None = None  # a heads folder or untrained:K; None: plain decoding
    draft_vocab: int | None = None  # tokens the heads rank (None: the machine's default)
    tree: str | None = None  # --tree's values or grown:N; None: the Budget's adapted trees
    context: bool = False  # context candidates merged into the heads' trees
    acceptance: str = "greedy"  # greedy, typical, rejection or speculative (drawn candidates)
    temperature: float = 0.0
    top_p: float = 1.0
    eps: float = 0.09  # typical acceptance's
    delta: float = 0.3
    seed: int | None = None
    # speculative decoding with a draft model (speculative_decoding.py): this model's file in a
    # format (int4, w4a8, int8) or another model folder; and the heads it drafts with (greedy)
    draft_model: str | None = None
    draft_model_heads: str | None = None

    def __post_init__(self):
        experiments.register_decoding()  # Hydra++'s heads kind, before any heads are read


def decoding_model(recipe: Recipe, check=None, probe: list[int] | None = None) -> tuple[Llama, str]:
    """(the model for decoding, how its step runs in words): read block by block in the
    recipe's format (load.formatted_model), then its speed plugged in (speed/plug_in.py).
    check(model), if given, runs on the model as read, before its speed: flags that must fit
    the model fail there in seconds, not after the compiler's warm-up. probe: token ids on
    which the fast step's logits are held to the eager step's (speed/reference_check.py);
    eager where they part."""
    if not Path(recipe.folder).is_dir():
        raise UserError(f"model folder {recipe.folder} does not exist")
    model = formatted_model(recipe.folder, recipe.device, recipe.weight_format)
    if check is not None:
        check(model)
    step = plug_in(model, recipe.weight_format, recipe.compile)
    return model, step if probe is None else checked_step(model, step, probe)


def decoding_heads(spec: str, model: Llama, draft_vocab: int | None = None):
    """The heads of `spec` (heads_reading.read_heads) in the model's weight format."""
    return plug_in_heads(read_heads(spec, model, draft_vocab), model)


@dataclass
class Decoding:
    """A recipe built on a loaded model: plain decoding (decoding.plain_decode, the reference:
    its `sampling`), or the one loop's draft, budget and `acceptance` (decoding.medusa_decode:
    the heads' trees, or a draft model's chains); describe() names it in words (after a run:
    the tree sizes the budget used); margin: the tree tokens a step writes past the sequence,
    which a conversation's cache must have room for."""
    model: Llama
    describe: Callable[[], str]
    sampling: Sampling | None = None
    draft: object | None = None
    budget: object | None = None
    acceptance: Acceptance | None = None

    def decode(self, prompt_ids: list[int], n: int, stop_ids: set[int], cache=None):
        """The steps (decoding.Step: the tokens each added, what it verified), one by one."""
        if self.draft is None:
            return plain_decode(self.model, prompt_ids, n, self.sampling, stop_ids, cache)
        return medusa_decode(self.model, self.draft, self.budget, self.acceptance, prompt_ids, n,
                             stop_ids, cache)

    @property
    def margin(self) -> int:
        return 0 if self.budget is None else max(self.budget.sizes) + 1

    def seeded(self, seed: int | None) -> "Decoding":
        """The same decoding, its draws seeded so (bench: a question's seed)."""
        if self.draft is None:
            return replace(self, sampling=replace(self.sampling, seed=seed))
        return replace(self, acceptance=replace(self.acceptance, seed=seed))


def build(recipe: Recipe, model: Llama, heads=None, drafter: Llama | None = None) -> Decoding:
    """The recipe's decoding on `model` (decoding_model's), with `heads` where they are loaded
    already (decoding_heads'), else the recipe's read here; with a draft model, `drafter`
    where it is loaded already (draft_model's), else read here."""
    device = model.embed.weight.device
    if recipe.draft_model is not None:
        return drafted(recipe, model, drafter if drafter is not None else draft_model(recipe)[0])
    if recipe.heads is None:
        return Decoding(model, lambda: "plain", sampling_for(device, recipe.temperature,
                                                             recipe.top_p, recipe.seed))
    heads = decoding_heads(recipe.heads, model, recipe.draft_vocab) if heads is None else heads
    rule = acceptance_of(recipe, device)
    draft, budget, tree = medusa_draft(recipe, heads, model, rule)
    kind = heads.config.head_kind + (f" heads (draft vocabulary {ranked_vocab_size(heads, model)})"
                                     if heads.vocabulary is not None else " heads")
    return Decoding(model, lambda: f"{kind}, {tree()}, {rule.name}",
                    draft=wrapped(draft, heads, recipe.context), budget=budget, acceptance=rule)


def draft_recipe(recipe: Recipe) -> Recipe:
    """The draft model's own recipe: this model's file in the format recipe.draft_model names
    (on the CPU, where the formats' kernels are), or the folder it names in its machine
    format; its step as recipe.compile asks; its heads recipe.draft_model_heads."""
    spec = recipe.draft_model
    check_draft(spec, recipe.folder)
    fmt = draft_format(spec)
    if fmt is not None:
        where, device = recipe.folder, torch.device("cpu")
    else:
        where, device = Path(spec), recipe.device
        fmt = machine_format(device, where)
    return Recipe(folder=where, device=device, weight_format=fmt, compile=recipe.compile,
                  heads=recipe.draft_model_heads, draft_vocab=recipe.draft_vocab)


def draft_model(recipe: Recipe) -> tuple[Llama, str]:
    """(the draft model, how its step runs in words), read as its recipe says."""
    return decoding_model(draft_recipe(recipe))


def drafted(recipe: Recipe, model: Llama, drafter: Llama) -> Decoding:
    """Speculative decoding (speculative_decoding.py) in the one loop: the draft model's chains
    (a DraftModelWithHeads where it drafts with heads), verified by greedy acceptance or
    speculative sampling; each step's k chosen by a Budget over DRAFT_SIZES, its priors the
    chain steps' latencies, timed with this draft and rule, and KEPT_PRIOR."""
    rule = acceptance_of(recipe, model.embed.weight.device)
    if recipe.draft_model_heads is not None and recipe.temperature == 0:
        inner = build(draft_recipe(recipe), drafter)  # its own trees' Budget
        draft = DraftModelWithHeads(drafter, inner.draft, inner.budget, inner.acceptance)
    else:
        draft = ModelDraft(drafter, recipe.temperature, recipe.top_p, recipe.seed)
    latency, source = machine_latency(model, draft, rule, [k for k in DRAFT_SIZES if k])
    budget = Budget(DRAFT_SIZES, expected_tokens(), latency)

    def describe() -> str:
        heads = (f" with its heads ({draft.budget.summary()})"
                 if isinstance(draft, DraftModelWithHeads) else "")
        kept = f"{draft.kept}/{draft.proposed}" if draft.proposed else "none"
        return (f"speculative decoding, drafts by the {recipe.draft_model} model{heads} (chains "
                f"of {budget.summary()}, latencies {source}; drafts kept: {kept}), {rule.name}")
    return Decoding(model, describe, draft=draft, budget=budget, acceptance=rule)


def acceptance_of(recipe: Recipe, device: torch.device) -> acceptance.Acceptance:
    """The recipe's rule at its temperature (acceptance.py, speculative_sampling.py); greedy on
    a CPU walked on the host (speed/host_greedy.py: the same tokens, fewer operators)."""
    T = recipe.temperature
    if recipe.acceptance == "typical":
        return acceptance.typical(T, recipe.eps, recipe.delta)
    if recipe.acceptance == "rejection":
        return acceptance.rejection(T, recipe.top_p, recipe.seed)
    if recipe.acceptance == "speculative":
        return speculative(T, recipe.top_p, recipe.seed)
    return greedy_for(device)


def medusa_draft(recipe: Recipe, heads, model: Llama, rule):
    """(the heads' draft, the budget, describe) as recipe.tree asks: ranked:N (each step's N
    most probable nodes), grown:N (the first N nodes grown from the heads' calibration), a
    fixed tree (the paper's one tree every step), or by default the nested trees
    and the Budget that picks among them and plain steps, their latencies timed with this draft
    and `rule` (ranked with --tree ranked). Candidates drawn at the temperature where the rule
    is speculative sampling (DrawnDraft, its draws seeded apart from the acceptance's coins)."""
    spec = tree_spec(recipe.tree)
    if spec.kind == "ranked" and spec.size is not None:
        return (RankedDraft(heads), FixedSize(spec.size),
                lambda: f"confidence-ranked tree of {spec.size} nodes (--tree)")
    if spec.kind == "grown":
        tree = budget_trees(heads, model, recipe.heads, [spec.size]).trees[spec.size]
        return (heads_draft(recipe, heads, {spec.size: tree}, model), FixedSize(spec.size),
                lambda: f"the grown tree of {spec.size} nodes (--tree)")
    if spec.kind == "fixed":
        name, tree = decoding_tree(spec.name, heads, model)
        return (heads_draft(recipe, heads, {tree.size - 1: tree}, model), FixedSize(tree.size - 1),
                lambda: f"tree {name} ({tree.size - 1} nodes, --tree)")
    grown = budget_trees(heads, model, recipe.heads)
    draft = (RankedDraft(heads) if spec.kind == "ranked" else
             heads_draft(recipe, heads, grown.trees, model, grown.rank))
    # timed: the run's draft and rule, without context chains (as timed_parts)
    latency, source = machine_latency(model, wrapped(draft, heads, False), rule, list(grown.trees))
    budget = grown.budget(latency, recipe.context)
    shape = "confidence-ranked tree" if spec.kind == "ranked" else "tree"
    joined = " and context candidates" if recipe.context else ""
    return (draft, budget,
            lambda: f"{shape} of {budget.summary()}{joined}: {grown.why}, latencies {source}")


def heads_draft(recipe: Recipe, heads, trees: dict, model: Llama, rank: dict | None = None):
    """The heads' guesses on the trees (their paths ranked by `rank`: the grown order; None:
    each tree's own), their top-k (TreeDraft), or drawn at the temperature for speculative
    sampling (DrawnDraft); fused where speed fuses them."""
    if recipe.acceptance != "speculative":
        return fast_draft(TreeDraft(heads, trees, rank), model)
    seed = None if recipe.seed is None else recipe.seed + 1
    return fast_draft(DrawnDraft(heads, trees, recipe.temperature, seed, rank), model)


def timed_parts(recipe: Recipe, heads, trees: dict, model: Llama):
    """(draft, rule) whose steps a Budget over `trees` is timed by, as medusa_draft times them:
    the run's own draft (without context chains) and acceptance (the training's tree search
    times them ahead of generate.py, under the key generate.py reads)."""
    rule = acceptance_of(recipe, model.embed.weight.device)
    return wrapped(heads_draft(recipe, heads, trees, model), heads, False), rule


def wrapped(draft, heads, context: bool):
    """The draft as a run needs it: read through a Hydra++ draft layer, with context chains."""
    draft = PlusPlusDraft(draft) if isinstance(heads, HydraPlusPlusHeads) else draft
    return ContextDraft(draft) if context else draft
