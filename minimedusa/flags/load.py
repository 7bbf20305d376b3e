"""From command-line flags to what decoding needs: the device and weight format, the model (its
speed plugged in: speed/plug_in.py), the heads, the tree (a fixed --tree, or by default
budget.py's nested trees and the Budget that picks among them) and the acceptance rule,
decided here once for generate.py, bench and tree_search alike.
"""
import json
import sys
from pathlib import Path

import torch

from minimedusa import acceptance
from minimedusa.budget import (SIZES, Budget, FixedSize, expected_length, fixed, grow_tree,
                               nested_trees)
from minimedusa.context_candidates import CHAIN, ContextDraft
from minimedusa.draft import TreeDraft
from minimedusa.experiments.draft_layer import HydraPlusPlusHeads, PlusPlusDraft
from minimedusa.errors import UserError
from minimedusa.files.heads_files import (DRAFT_VOCAB_FILE, HeadsError, load_heads,
                                          read_calibration, read_draft_vocab)
from minimedusa.files.weights import load_model, read_tensor, safetensors_files, tensor_files
from minimedusa.flags.device import pick_device, pick_dtype
from minimedusa.flags.trees import default_tree, ranked_size, tree_choices
from minimedusa.heads import DraftVocabulary, MedusaHeads
from minimedusa.hydra import HydraHeads
from minimedusa.model import Llama
from minimedusa.ranked_tree import RankedDraft
from minimedusa.speed.fused_draft import fast_draft
from minimedusa.speed import group_kernel
from minimedusa.speed.plug_in import plug_in, plug_in_heads
from minimedusa.speed.grids import on_four_bit_grid
from minimedusa.speed.kept_weights import KeptBlocksError, keep, read_kept, worth_keeping
from minimedusa.speed.step_latency import machine_latency
from minimedusa.speed.weight_formats import DTYPE_FORMATS, bf16_is_native, block_format
from minimedusa.tree import MedusaTree, build_tree


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    """The flags' device and dtype; sets torch's CPU threads if asked."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    return device, pick_dtype(args.dtype, device)


def device_and_format(args, folder: Path) -> tuple[torch.device, str]:
    """The flags' device and weight format for decoding the model in `folder`
    (weight_formats.py): --quantize int8, int4 or w4a8, else --dtype, whose auto is the
    machine's and the model's default_format. Sets torch's CPU threads."""
    device, dtype = device_and_dtype(args)
    if args.quantize != "none":
        if args.device == "auto":
            device = torch.device("cpu")  # the quantized formats multiply on a CPU, GPU or not
        if device.type != "cpu" or args.dtype not in ("auto", "bfloat16", "bf16"):
            raise UserError(f"--quantize {args.quantize} runs on a CPU, its activations in the "
                            "dtype its kernels take (weight_formats.py): drop --dtype/--device")
        problem = group_kernel.kernel_problem() if args.quantize == "w4a8" else None
        if problem is not None:
            raise UserError(f"--quantize w4a8 multiplies in group_kernel.c only, which does not "
                            f"here: {problem}")
        return device, args.quantize
    if args.dtype == "auto":
        return device, default_format(device, folder)
    name = str(dtype).removeprefix("torch.")
    if device.type == "cpu" and name == "bfloat16" and not bf16_is_native():
        print("minimedusa: this CPU has neither avx512_bf16 nor AMX, so bfloat16 products run "
              "without native kernels, slower than float32 (--dtype float32 is faster here)",
              file=sys.stderr)
    return device, name


def decoding_model(folder: Path, device, weight_format: str, compile_flag: bool | None = False,
                   check=None) -> tuple[Llama, str]:
    """(the model for decoding, how its step runs in words): loaded, then its speed plugged in
    (speed/plug_in.py): the weight format's layers, the step compiled as --compile asks.
    check(model), if given, runs on the model as read, before its speed: flags that must fit
    the model fail there in seconds, not after the compiler's warm-up."""
    if not Path(folder).is_dir():
        raise UserError(f"model folder {folder} does not exist")
    model = formatted_model(folder, device, weight_format)
    if check is not None:
        check(model)
    return model, plug_in(model, weight_format, compile_flag)


def formatted_model(folder: Path, device, weight_format: str) -> Llama:
    """The model, each block in the format as it is read: a dtype's weights read straight into
    it, int8's and int4's rounded from the weights as stored, so that the model is never held
    whole in another dtype beside its format's bytes (peak memory). A large model's rounded
    blocks are kept after the first run and read back by later ones (speed/kept_weights.py)."""
    device = torch.device(device)
    dtype, convert = DTYPE_FORMATS.get(weight_format), block_format(weight_format)
    kept = read_kept(folder, weight_format) if device.type == "cpu" else None
    if kept is not None:
        try:
            return load_model(folder, device, dtype, convert, kept)
        except KeptBlocksError as e:
            print(f"minimedusa: the kept weights were damaged ({e}); rounding again",
                  file=sys.stderr)
    model = load_model(folder, device, dtype, convert)
    if device.type == "cpu" and worth_keeping(model.config, weight_format):
        keep(folder, weight_format, model)
    return model


def decoding_heads(spec: str, model: Llama, draft_vocab: int | None = None):
    """A heads folder, or 'untrained:K' / 'untrained-shared:K' / 'untrained-hydra:K': K fresh
    heads (own / shared projection / Hydra's) in the paper's initialisation, for trying the
    machinery without training. With a draft vocabulary of draft_vocab tokens (None: the
    folder's default), and in the model's weight format (weight_formats.py)."""
    heads, config = None, {}
    for prefix in ("untrained:", "untrained-shared:", "untrained-hydra:"):
        if spec.startswith(prefix):
            count = spec.removeprefix(prefix)
            if not count.isdigit() or int(count) < 1:
                raise HeadsError(f"bad heads {spec!r}: use {prefix}K with K >= 1")
            heads = (HydraHeads.for_model(model, int(count)) if prefix == "untrained-hydra:" else
                     MedusaHeads.for_model(model, int(count),
                                           shared_lm_head=prefix == "untrained-shared:"))
            heads.eval().requires_grad_(False)
    if heads is None:
        if not Path(spec).is_dir():
            raise HeadsError(f"heads folder {spec} does not exist")
        heads = load_heads(spec, model)
        config = json.loads((Path(spec) / "config.json").read_text())
    size = (cpu_draft_vocab(config.get("draft_vocab_size", 0), model) if draft_vocab is None
            else draft_vocab)
    if size:
        heads.vocabulary = draft_vocabulary(spec, heads, model, size)
    return plug_in_heads(heads.float(), model)


# On a CPU the heads rank at most this many tokens by default: the draft's LM head reads V' x C
# bytes a depth, mostly from memory (the model's weights have just streamed through the caches).
# Interleaved in one process on the 2-core AVX2 EPYC (bench --draft-vocab 8192 2048, the
# default model's Hydra heads, whose own is 8,192), Hydra greedy against plain decoding: in
# w4a8 1.06x -> 1.13x, then 1.16x -> 1.14x (1024: 1.15x); in int4 earlier 1.23x -> 1.31x and
# 1.23x -> 1.30x (weights/RESULTS.md): faster in three runs of four, within the machine's noise
# in the fourth. The 2,048 most frequent cover 91.6% of their training answers' tokens.
# Not on a GPU, whose larger trees reach further down the heads' ranks (unmeasured there).
CPU_DRAFT_VOCAB = 2048


def cpu_draft_vocab(size: int, model: Llama) -> int:
    """The heads' own draft vocabulary size (0: none), cut to CPU_DRAFT_VOCAB on a CPU."""
    on_cpu = model.embed.weight.device.type == "cpu"
    return min(size, CPU_DRAFT_VOCAB) if size and on_cpu else size


def draft_vocabulary(spec: str, heads, model: Llama, size: int) -> DraftVocabulary:
    """The `size` tokens most frequent in the heads' training answers (weights.save_draft_vocab)."""
    if not heads.config.shared_lm_head:
        raise HeadsError("a draft vocabulary cuts the shared LM head: these heads have their "
                         "own projections (use --draft-vocab 0)")
    counted = read_draft_vocab(spec) if Path(spec).is_dir() else None
    if counted is None:
        raise HeadsError(f"--draft-vocab: the heads {spec} have no {DRAFT_VOCAB_FILE} (train.py "
                         "writes it); use --draft-vocab 0")
    ids, _ = counted
    if not 0 < size <= model.config.vocab_size:
        raise UserError(f"--draft-vocab must be in 1..{model.config.vocab_size}, got {size}")
    return DraftVocabulary(ids[:size].sort().values, model.lm_head)


def ranked_vocab_size(heads, model: Llama) -> int:
    """How many tokens the heads rank: their draft vocabulary's, else the model's."""
    return model.config.vocab_size if heads.vocabulary is None else heads.vocabulary.ids.numel()


def decoding_tree(spec: str | None, heads, model: Llama) -> tuple[str, MedusaTree]:
    """(name, tree) for a --tree value, checked against the heads it will read and the
    vocabulary they rank; without one, the device's default named tree without the paths
    deeper than the heads."""
    device = model.embed.weight.device
    if spec is not None:
        name, choices = spec, tree_choices(spec)
    else:  # a general tree, made for any heads: keep the paths these heads can read
        name, depth = default_tree(device), heads.config.medusa_num_heads
        every = tree_choices(name)
        choices = [path for path in every if len(path) <= depth]
        if len(choices) < len(every):
            name += f" (cut to its paths of at most {depth} nodes: {depth} heads)"
    return name, build_tree(choices, heads.config.medusa_num_heads,
                            ranked_vocab_size(heads, model), device)


def decoding_budget(heads, model: Llama, heads_spec: str, context: bool = False):
    """(trees by size, the Budget that picks among them and plain steps, why these): the tree
    grown from the heads' calibration at every size up to 16 nodes on a CPU (where a 16-node
    step already cost 1.5-2x a plain one on the 2-core machines measured) or 64 on a GPU; for
    heads without a calibration, the default tree or plain steps. Step latencies: measured on
    this machine at first use, then cached (budget.py). context: whether decoding reads context
    chains (the Budget then knows how many tokens one proposes: context_candidates.CHAIN)."""
    weight = model.embed.weight
    folder = Path(heads_spec)
    accuracy = read_calibration(folder) if folder.is_dir() else None
    if accuracy is None:
        name, tree = decoding_tree(None, heads, model)
        nodes, sizes, expected = tree.nodes[1:], [tree.size - 1], {}
        why = f"{name} or plain steps (the heads have no calibration.json)"
    else:
        nodes, probs = grow_tree(accuracy, 64 if weight.device.type == "cuda" else 16)
        sizes = [n for n in SIZES if n <= len(nodes)]
        expected = {n: expected_length(probs[:n]) for n in sizes}
        why = "grown from the heads' calibration"
    trees, rank = nested_trees(nodes, sizes, heads.config.medusa_num_heads,
                               ranked_vocab_size(heads, model), weight.device)
    latency, source = machine_latency(model, heads, trees)
    return (trees, Budget([0, *sizes], expected, latency, rank, chain=CHAIN if context else 0),
            f"{why}, latencies {source}")


def decoding_draft(spec: str | None, heads, model: Llama, heads_spec: str, context: bool):
    """(draft, budget, describe) for decoding.medusa_decode as --tree asks: a fixed tree
    (budget.fixed: the paper's one tree every step), ranked:N (each step's N most probable
    nodes), or by default the nested trees and the Budget that picks among them and plain
    steps, ranked (ranked_tree.RankedDraft) with --tree ranked; with context candidates
    (context_candidates.ContextDraft) where `context`; Hydra++ heads' draft reads through their
    layer. describe() says which, after the run (the sizes the budget used)."""
    if spec is not None and spec.startswith("ranked:"):
        size = ranked_size(spec)
        return (wrapped(RankedDraft(heads), heads, False), FixedSize(size),
                lambda: f"confidence-ranked tree of {size} nodes (--tree)")
    if spec is not None and spec != "ranked":
        name, tree = decoding_tree(spec, heads, model)
        draft, budget = fixed(heads, tree)
        return (wrapped(fast_draft(draft, model), heads, False), budget,
                lambda: f"tree {name} ({tree.size - 1} nodes, --tree)")
    trees, budget, why = decoding_budget(heads, model, heads_spec, context)
    draft = RankedDraft(heads) if spec == "ranked" else fast_draft(TreeDraft(heads, trees), model)
    shape = "confidence-ranked tree" if spec == "ranked" else "tree"
    joined = " and context candidates" if context else ""
    return (wrapped(draft, heads, context), budget,
            lambda: f"{shape} of {budget.summary()}{joined}: {why}")


def wrapped(draft, heads, context: bool):
    """The draft as a run needs it: read through a Hydra++ draft layer, with context chains."""
    draft = PlusPlusDraft(draft) if isinstance(heads, HydraPlusPlusHeads) else draft
    return ContextDraft(draft) if context else draft


def decoding_acceptance(args, device: torch.device) -> acceptance.Acceptance:
    """--acceptance: 'auto' (greedy at temperature 0, lossless rejection sampling above),
    'greedy', 'typical' or 'rejection', with --temperature, --top-p, --eps, --delta, --seed.
    Greedy on a CPU is walked on the host (acceptance.greedy_walked_on_host: the same tokens,
    fewer operators)."""
    kind, temperature = args.acceptance, args.temperature
    if kind == "auto":
        kind = "greedy" if temperature == 0 else "rejection"
    if kind == "greedy":
        if temperature != 0:
            raise UserError("--acceptance greedy decodes at temperature 0: drop --temperature "
                            "or use --acceptance typical or rejection")
    if kind == "typical":
        return acceptance.typical(temperature, args.eps, args.delta)
    if kind == "rejection" and temperature != 0:
        return acceptance.rejection(temperature, args.top_p, args.seed)
    return acceptance.greedy_for(device)


def default_format(device: torch.device, folder=None) -> str:
    """generate.py's format for the model in `folder` when none is asked for: bfloat16 on CUDA.
    On a CPU, for a model whose weights came from a 4-bit file (four_bit_checkpoint: its 4-bit
    weights then lose nothing), where group_kernel.c multiplies them:
    - on AVX2 without avx512_bf16 (only the kernel's AVX2 path runs), w4a8: 8-bit activations in
      the wo and gate_up products (quantized.EIGHT_BIT_INPUTS), 16-bit ones in wqkv and down.
      On the 2-core AVX2 EPYC, in one process (bench --formats int4,w4a8, 8 MT-Bench first
      turns), its plain decoding 1.20x int4's and Hydra greedy 1.13-1.17x with float32 rows in
      wqkv and down, 1.04-1.08x and 1.09-1.11x faster again with 16-bit ones (RESULTS.md,
      session 16); top-1 agreement with float32 98.97%, mean KL 0.0007 (format_quality.py, 48
      held-out chats), where llama.cpp's own decoding of the same GGUF, with 8-bit activations
      in every product, is 97.8%, 0.0025 (the bar for 8-bit activations in a default: what
      llama.cpp's users already accept). int4 (--quantize int4) keeps float32's answers;
    - on AVX-512 BF16, int4 with bfloat16 activations and float32 logits (top-1 99.07%, KL
      0.0003, on the 2-core Zen 5; with bfloat16 logits 98.51%, 0.0006). There, in one process
      (bench --formats int4,w4a8), w4a8's plain decoding ran as fast and its Hydra greedy at
      1.10x its plain, int4's at 1.20x: w4a8's float32 cache and steps cost more than VNNI's
      products save (a forward after 1,536 cached tokens 9.1 ms against 7.3), and with
      bfloat16 activations w4a8 falls to 98.05%;
    - where oneDNN multiplies bfloat16 natively, int4 through torch's kernel.
    Otherwise bfloat16 where that is native (half float32's bytes, a step as flat in the
    tree's size), else float32."""
    if device.type == "cuda":
        return "bfloat16"
    four_bit = folder is not None and four_bit_checkpoint(folder)
    if four_bit and group_kernel.takes_float32() and not group_kernel.multiplies_bfloat16():
        return "w4a8"  # the AVX2 path, its kernel running
    if four_bit and (bf16_is_native() or group_kernel.kernel_problem() is None):
        return "int4"
    return "bfloat16" if bf16_is_native() else "float32"


def four_bit_checkpoint(folder) -> bool:
    """Whether every weight of the model's blocks in `folder` lies on a 4-bit grid of GROUP
    (what a GGUF's Q4_0, Q4_1 or Q4_K file converted to floats holds); stops at the first that
    does not (one matrix read for most models). Asked once a process for a folder as it is
    (the default format asks, and the summary line)."""
    if not Path(folder).is_dir():
        return False  # the loader says so, in its words
    files = safetensors_files(folder)
    key = (str(Path(folder).resolve()), *((f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in _four_bit:
        _four_bit[key] = all(on_four_bit_grid(read_tensor(path, name))  # one tensor in memory
                             for name, path in tensor_files(files).items()
                             if ".layers." in name and name.endswith("proj.weight"))
    return _four_bit[key]


_four_bit: dict[tuple, bool] = {}  # four_bit_checkpoint's answers, by folder and files
