"""From a model to its heads in one command: python train.py --frozen [--model DIR] (no --data).

Three stages into OUT (default weights/<model folder>-trained): (1) self-distillation, the
model answers seed prompts into OUT/data (self_distill.py, paper section 5); (2) Medusa-1
training on those answers (train.py's loop); (3) calibration and the tree search for this
machine (tree_search.py). Each prints its expected time, timed on a probe, before it starts,
and resumes where it stopped, or is skipped when done: Ctrl-C, then the same command, loses
nothing finished. The defaults are the shipped heads' recipe. Left out: Medusa-2 (it trains on
data made beforehand).
"""
import time
from pathlib import Path

import torch

from minimedusa.budget import grow_tree
from minimedusa.files.heads_files import read_calibration
from minimedusa.assembly.latency_cache import latency_key, read_cached
from minimedusa.speed.weight_formats import FLOAT16, FORMATS, format_named
from minimedusa.files.checkpoint import CHECKPOINT
from minimedusa.files.outputs import lock_folder, write_json
from minimedusa.cli.flags import positive_int
from minimedusa.assembly.load import machine_format
from minimedusa.assembly.recipe import Recipe, decoding_heads, decoding_model, timed_parts
from minimedusa.training.progress import minutes, progress_bar, say
from minimedusa.files.default_model import WEIGHTS_DIR, ensure_default_model
from minimedusa.assembly.device import pick_device, pick_dtype
from minimedusa.errors import UserError
from minimedusa.training.self_distill import (Settings, answering_model, batch_seconds, distill,
                                              open_folder, pending_batches)
from minimedusa.training.seed_prompts import seed_prompts
from minimedusa.files.tokenizer import Tokenizer, read_json_object
from minimedusa.training.loop import batch_rows, total_steps
from minimedusa.training.tree_search import (MAX_NODES, calibrate_on, held_out_rows,
                                             search_seconds, size_trees, time_sizes)
from minimedusa.files.weights import read_config

# The recipe of the shipped heads' first stage (weights/README.md; they were then trained on
# answers to model-written turns too): the defaults of these train.py flags when the data comes
# from the model alone.
RECIPE = {"kind": "hydra", "layers": 2, "lr": 2e-3, "epochs": 2.0, "draft_vocab": 8192,
          "eval_every": 500}
CPU_PROMPTS, MAX_NEW_TOKENS = 2048, 192  # about an hour in all on a 2-core CPU
BATCH_SIZES = {"cpu": 64, "cuda": 256}  # prompts answered at once, by device type


def add_flags(p) -> None:
    """train.py's flags of this pipeline."""
    alone = p.add_argument_group(
        "From the model alone (--frozen without --data)",
        "python train.py --frozen [--model DIR] makes heads in one command, in three stages: "
        "(1) the model answers seed prompts (self-distillation, paper section 5) into OUT/data, "
        "(2) the heads train on those answers, (3) calibration and the tree search time the "
        "trees on this machine. Each stage prints its expected time before it starts and "
        "resumes where it stopped, or is skipped when done: after Ctrl-C run the same command "
        "again. The defaults are the shipped heads' recipe (4 Hydra heads x 2 blocks, draft "
        "vocabulary 8192, 2 epochs), sized to take about an hour on a 2-core CPU: "
        f"{CPU_PROMPTS} prompts, answers of up to {MAX_NEW_TOKENS} tokens; on a GPU all "
        "the seed prompts, in batches of 256.")
    alone.add_argument("--prompts", type=positive_int, default=None, metavar="N",
                       help=f"seed prompts to answer (default: {CPU_PROMPTS} on a CPU, "
                       "every seed prompt on a GPU)")
    alone.add_argument("--decode-format", choices=DECODE_FORMATS, default="auto",
                       help="the weight format stage 3 calibrates the heads in and times their "
                       "trees in, as generate.py will decode with them (default: auto, "
                       "generate.py's own default here, see its --dtype; int8, int4 and w4a8 "
                       "run on the CPU, also after training on a GPU)")


STAGES = 3
# the formats stage 3 may time: a CPU's (float16 is a GPU's)
DECODE_FORMATS = ("auto", *(name for name, fmt in FORMATS.items() if fmt is not FLOAT16))


def check_model_folder(folder: Path) -> None:
    """Refuse in one line, before an hour of work, a model this code cannot run (another
    architecture, a rope scaling it does not implement) or cannot ask in its own chat format."""
    read_config(folder)
    Tokenizer.from_folder(folder).chat_prompt([{"role": "user", "content": "Hello"}])


def check_recipe(args) -> None:
    """OUT/recipe.json keeps the training flags OUT was started with: resuming with others would
    mix two runs in one checkpoint."""
    names = ("kind", "heads", "layers", "shared", "draft_vocab", "epochs", "lr", "batch_size",
             "warmup", "weight_decay", "clip", "grad_accum", "seed", "prompts")
    recipe = {n: getattr(args, n) for n in names}
    path = args.out / "recipe.json"
    if path.is_file() and (old := read_json_object(path)) != recipe:
        changed = ", ".join(f"--{n.replace('_', '-')} {old.get(n)} -> {recipe[n]}"
                            for n in names if old.get(n) != recipe[n])
        raise UserError(f"{args.out} was started with other settings ({changed}); run it with "
                        "its own or give another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(path, recipe)


def distillation_stage(args, folder: Path, device, say) -> None:
    """Stage 1: the model answers seed prompts into OUT/data, one shard per batch."""
    cpu, dtype = device.type == "cpu", pick_dtype("auto", device)
    settings = Settings(limit=args.prompts or (CPU_PROMPTS if cpu else None),
                        batch_size=BATCH_SIZES[device.type], max_new_tokens=MAX_NEW_TOKENS)
    prompts = seed_prompts(settings.seed)
    if settings.limit is not None and settings.limit > len(prompts):
        raise UserError(f"--prompts {settings.limit}: there are {len(prompts)} seed prompts")
    prompts = prompts[:settings.limit]
    open_folder(args.data, folder, settings, len(prompts), dtype)
    todo = pending_batches(args.data, prompts, settings.batch_size)
    if not todo:
        return say(f"stage 1/{STAGES}, self-distillation: done ({args.data})")
    model, tokenizer = answering_model(folder, device, dtype), Tokenizer.from_folder(folder)
    seconds = len(todo) * batch_seconds(model, tokenizer, todo[0][1], settings)
    say(f"stage 1/{STAGES}, self-distillation: the model answers {len(prompts)} seed prompts "
        f"(up to {settings.max_new_tokens} tokens each) in batches of {settings.batch_size}, "
        f"{len(todo)} batches to go, into {args.data}: expected {minutes(seconds)}")
    distill(model, tokenizer, args.data, prompts, settings, progress_bar())


def training_seconds(mode, args, steps: int) -> float:
    """The expected time of `steps` optimizer steps and their validations: one step's loss and
    backward timed after a warm-up one, and one validation (the heads do not change)."""
    index = batch_rows(mode.rows(), 0, mode.batch_size(), args.seed)
    mode.loss(0, index).total.backward()
    start = time.perf_counter()
    mode.loss(0, index).total.backward()
    step = time.perf_counter() - start
    mode.optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    mode.evaluate()
    return steps * step + (steps // args.eval_every + 1) * (time.perf_counter() - start)


def training_stage(args, device, say, medusa1, train_loop) -> None:
    """Stage 2: Medusa-1 on OUT/data, from the checkpoint if there is one. The heads' config.json
    is the last file training writes (weights.save_heads): with it, the stage is done."""
    if (args.out / "config.json").is_file():
        return say(f"stage 2/{STAGES}, training: done ({args.out})")
    args.resume = (args.out / CHECKPOINT).is_file()
    mode = medusa1(args, device, 1)
    if mode.rows() < mode.batch_size():  # a few --prompts: a batch of every row, not none
        say(f"stage 2/{STAGES}, training: {mode.rows()} answer positions, fewer than a batch "
            f"of {mode.batch_size()}: batches of {mode.rows()}")
        args.batch_size = mode.rows()
    _, last = total_steps(args, mode.rows(), mode.batch_size())
    first = (torch.load(args.out / CHECKPOINT, weights_only=True)["step"] if args.resume else 0)
    say(f"stage 2/{STAGES}, training: {last - first} steps to go, expected "
        f"{minutes(training_seconds(mode, args, last - first))}")
    mode.finish(train_loop(mode, args, 0, 1, device, say), say)


def tree_stage(args, folder: Path, device, say) -> None:
    """Stage 3: calibrate the heads on held-out answers and time each tree size here, for
    generate.py (tree_search.py). Done when both the calibration and this machine's step
    latencies are there. A CPU format (--decode-format int4 after training on a GPU) is
    calibrated and timed on the CPU, where generate.py will decode in it."""
    fmt = decode_format(args.decode_format, device, folder)
    if fmt.rounds:
        device = torch.device("cpu")
    # timed on the step generate.py decodes with where that costs no warm-up (int4, w4a8, and
    # bfloat16 where group_kernel.c multiplies it: the fused step, ~2.5x faster than their
    # eager one: a tree's worth is another there); other formats on their eager step (a
    # compiled one's warm-up: minutes on a 2-core CPU)
    step = None if fmt.fused() else False
    recipe = Recipe(folder=folder, device=device, weight_format=fmt, compile=step,
                    heads=str(args.out))
    model, _ = decoding_model(recipe)
    heads = decoding_heads(recipe.heads, model)
    timed = timed_parts(recipe, heads, size_trees(model, heads, [(0,)], 1), model)
    if read_calibration(args.out) is not None and read_cached(latency_key(model, *timed)):
        return say(f"stage 3/{STAGES}, tree search: done (calibrated, this machine timed)")
    val = held_out_rows(args.data, heads, model, folder)
    say(f"stage 3/{STAGES}, tree search: calibration on {val.targets.shape[0]} held-out "
        f"positions, then each tree size timed on this machine: expected "
        f"{minutes(search_seconds(recipe, heads, model, val))}")
    nodes, probs = grow_tree(calibrate_on(val, args.out, args.data, heads, model), MAX_NODES)
    time_sizes(recipe, model, heads, nodes, probs, MAX_NODES)


def decode_format(name: str, device, folder: Path):
    """--decode-format's weight format: the one named, or generate.py's default for this
    machine and model."""
    return machine_format(device, folder) if name == "auto" else format_named(name)


def from_model(args, medusa1, train_loop) -> None:
    """python train.py --frozen [--model DIR]: the three stages, each resumed or skipped.
    medusa1 and train_loop: train.py's Medusa-1 setup and training loop, handed in so that
    they stay in the file a reader opens to see how the heads are trained."""
    device = pick_device(args.device)
    folder = args.model or ensure_default_model()
    check_model_folder(folder)
    args.out = args.out or WEIGHTS_DIR / f"{folder.name}-trained"
    args.data = args.out / "data"
    lock_folder(args.out, "train.py")
    check_recipe(args)
    size = ("sized for about an hour on a 2-core CPU" if device.type == "cpu" else
            "minutes on a GPU: 4,096 prompts took 4.4 min on an H100")
    say(f"heads for {folder} in {args.out}, from the model alone on {device} ({size}; Ctrl-C, "
        "then the same command, resumes)")
    start = time.time()
    for stage in (lambda: distillation_stage(args, folder, device, say),
                  lambda: training_stage(args, device, say, medusa1, train_loop),
                  lambda: tree_stage(args, folder, device, say)):
        began = time.time()
        stage()
        say(f"  ({minutes(time.time() - began)})")
    model = f" --model {args.model}" if args.model else ""
    say(f"done in {minutes(time.time() - start)}: python generate.py{model} --heads {args.out} "
        "--prompt ...")
