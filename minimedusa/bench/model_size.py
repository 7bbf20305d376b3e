"""Models of the size people bring: memory, start and decoding speed of a random model of a real
model's shape, beside llama.cpp's own tools on the same weights.

    python -m minimedusa.bench.model_size --shape tinyllama-1.1b --formats int4,bfloat16
    python -m minimedusa.bench.model_size --shape llama-7b --formats int4 --llama-cpp DIR

No real weights are needed (nor fetched): the script builds a model of the named shape with
random weights (bfloat16 safetensors in shards, the default model's tokenizer) in --folder,
once. Each format is then run as a user runs it, as generate.py processes (plain decoding,
greedy): twice,
the first start and a later one, each with its peak resident memory (the process's own, from
the operating system), its loading time and tokens/s; and a forward of 1, 2, 4 and 8 rows after
256 cached tokens (bench/step_profile.py, in a process of its own). With --llama-cpp, the folder
of llama.cpp's source built as the README says: its convert_hf_to_gguf.py makes BF16 and Q4_1
GGUFs of the same weights (with --convert-python, a Python that has transformers), and
llama-bench and llama-completion time and measure them. --isa avx2 runs this project's
processes as on a CPU with AVX2 and FMA alone (speed/machine.py), on a CPU with AVX-512 too;
give it a llama.cpp built for AVX2 alone (cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_AVX512=OFF). Speed figures hold for the machine they were measured on: the report
names it.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from minimedusa.errors import UserError, entry_point
from minimedusa.files.default_model import DEFAULT_MODEL_DIR, ensure_default_model
from minimedusa.files.outputs import check_writable, followed, write_json
from minimedusa.files.hf_config import config_to_hf
from minimedusa.files.weights import hf_parts
from minimedusa.cli.flags import Parser, format_list, positive_int
from minimedusa.model import Llama, LlamaConfig
from minimedusa.speed.cache_folder import cache_root
from minimedusa.speed.machine import AVX2_ENVIRONMENT, machine_key
from minimedusa.speed.weight_formats import FORMATS, format_named

REPO = Path(__file__).resolve().parents[2]
# real models' shapes (their config.json's sizes), with the default model's tokenizer: the
# vocabulary is SmolLM2's 49,152 (TinyLlama's own 32,000, Llama 2's 32,000)
SHAPES = {
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4),
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, qkv_bias=True,
                       tie_word_embeddings=True),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32),
}
PROMPT = "Write a short story about a lighthouse keeper."
ROWS = (1, 2, 4, 8)


def build_model(shape: str, folder: Path) -> None:
    """A random model of `shape` in `folder`: config.json, bfloat16 safetensors in shards of a
    block each (model.safetensors.index.json: a 7B model is built in one block's memory, and
    loaded as sharded folders are), the default model's tokenizer. Random normal weights (std
    0.02), norms 1."""
    cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=2048, rope_theta=10000.0,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **SHAPES[shape])
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Llama(cfg).state_dict().items()}
    shards: dict[str, dict[str, torch.Size]] = {}  # shard file -> its HF tensors' shapes
    for ours, parts in hf_parts(cfg).items():
        shard = ours.split(".")[1] if ours.startswith("layers.") else "rest"
        for hf, rows in parts:
            shards.setdefault(shard, {})[hf] = (shapes[ours] if rows is None
                                                else (rows, *shapes[ours][1:]))
    folder = followed(folder)  # a link: renamed onto where it points, the link kept
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    generator, weight_map = torch.Generator().manual_seed(0), {}
    for i, (shard, tensors) in enumerate(shards.items()):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({hf: random_weight(hf, size, generator) for hf, size in tensors.items()},
                  tmp / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    default = ensure_default_model(DEFAULT_MODEL_DIR)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / name, tmp / name)
    os.replace(tmp, folder)


def random_weight(name: str, size, generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(size, dtype=torch.bfloat16)
    return (torch.randn(size, generator=generator) * 0.02).to(torch.bfloat16)


def run_measured(command: list[str], timeout: float) -> tuple[str, float, int]:
    """(stdout, seconds, peak resident bytes) of a command: the child's own peak, as the
    operating system counted it (wait4), not the sum or maximum of every child so far."""
    with tempfile.TemporaryFile("w+", errors="replace") as out, \
            tempfile.TemporaryFile("w+", errors="replace") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=err, cwd=REPO)
        timer = threading.Timer(timeout, child.kill)
        timer.start()
        _, status, usage = os.wait4(child.pid, 0)
        timer.cancel()
        child.returncode = os.waitstatus_to_exitcode(status)  # waited for here, not by Popen
        seconds = time.perf_counter() - start
        out.seek(0), err.seek(0)
        if child.returncode != 0:
            said = err.read().strip().splitlines()
            raise UserError(f"{' '.join(command[:4])} ... failed (exit status "
                            f"{child.returncode}): {said[-1] if said else 'no message'}")
        return out.read(), seconds, usage.ru_maxrss * 1024  # Linux counts it in KB


def format_flags(name: str) -> list[str]:
    """generate.py's flags for the format of this name: --quantize one that rounds, else --dtype."""
    return ["--quantize" if format_named(name).rounds else "--dtype", name]


def generate_run(folder: Path, weight_format: str, threads: int, tokens: int) -> dict:
    """One generate.py process, plain greedy decoding: its numbers, and the process's peak."""
    command = [sys.executable, "generate.py", "--model", str(folder), "--prompt", PROMPT,
               "--max-new-tokens", str(tokens), "--baseline", "--json", "--threads",
               str(threads), *format_flags(weight_format)]
    out, seconds, peak = run_measured(command, timeout=3600)
    result = json.loads(out)
    return {"peak_gb": round(peak / 1e9, 3), "process_s": round(seconds, 1),
            "load_s": result["load_seconds"], "tokens_per_s": result["tokens_per_s"],
            "step": result["step"]}


FORWARDS = """
import sys, torch
from pathlib import Path
from minimedusa.bench.step_profile import forward_times, shape_times
from minimedusa.assembly.recipe import Recipe, decoding_model
from minimedusa.speed.weight_formats import format_named
torch.set_num_threads(int(sys.argv[3]))
model, _ = decoding_model(Recipe(folder=Path(sys.argv[1]), device=torch.device("cpu"),
                                 weight_format=format_named(sys.argv[2]), compile=None))
print(shape_times(model) if sys.argv[4] == "profile" else forward_times(model, rows=(1, 2, 4, 8)))
"""


def forward_ms(folder: Path, weight_format: str, threads: int) -> dict[int, float]:
    """A forward of M rows after 256 cached tokens, ms, for each M of ROWS."""
    out, _, _ = run_measured([sys.executable, "-c", FORWARDS, str(folder), weight_format,
                              str(threads), "forwards"], timeout=3600)
    return {int(m): float(ms) for m, ms in re.findall(r"M = (\d+) ([\d.]+)", out)}


def step_shapes(folder: Path, weight_format: str, threads: int) -> list[str]:
    """Where a plain step goes, product by shape (step_profile.shape_times), its lines."""
    out, _, _ = run_measured([sys.executable, "-c", FORWARDS, str(folder), weight_format,
                              str(threads), "profile"], timeout=3600)
    return out.strip().splitlines()


def gguf_files(llama_cpp: Path, folder: Path, python: str) -> dict[str, Path]:
    """The model's BF16 GGUF (llama.cpp's convert_hf_to_gguf.py) and its Q4_1 (llama-quantize),
    made once beside the model's folder."""
    files = {"BF16": folder.with_name(folder.name + "-bf16.gguf"),
             "Q4_1": folder.with_name(folder.name + "-q4_1.gguf")}
    if not files["BF16"].is_file():
        run_measured([python, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder),
                      "--outtype", "bf16", "--outfile", str(files["BF16"])], timeout=3600)
    if not files["Q4_1"].is_file():
        run_measured([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(files["BF16"]),
                      str(files["Q4_1"]), "Q4_1"], timeout=3600)
    return files


def llama_cpp_run(llama_cpp: Path, gguf: Path, threads: int, tokens: int) -> dict:
    """llama-completion as a user runs it (its peak memory, its own decoding rate) and
    llama-bench's decoding alone (tokens/s, the mean of 3 repetitions)."""
    binaries = llama_cpp / "build" / "bin"
    _, seconds, peak = run_measured(
        [str(binaries / "llama-completion"), "-m", str(gguf), "-t", str(threads), "-p", PROMPT,
         "-n", str(tokens), "-no-cnv", "--temp", "0", "--log-file", str(gguf) + ".log"],
        timeout=3600)
    log = Path(str(gguf) + ".log").read_text(errors="replace")
    rate = re.findall(r" eval time = .*?([\d.]+) tokens per second", log)
    out, _, _ = run_measured([str(binaries / "llama-bench"), "-m", str(gguf), "-t",
                              str(threads), "-p", "0", "-n", str(tokens), "-r", "3", "-o",
                              "json"], timeout=3600)
    bench = json.loads(out)[0]
    return {"peak_gb": round(peak / 1e9, 3), "process_s": round(seconds, 1),
            "tokens_per_s": float(rate[-1]) if rate else None,
            "bench_tokens_per_s": round(bench["avg_ts"], 2)}


def parse_args(argv=None):
    p = Parser(description="Memory, start and decoding speed of a random model of a real "
               "model's shape, as generate.py processes, beside llama.cpp's own tools.")
    p.prog = "python -m minimedusa.bench.model_size"  # as typed (else argparse names the file)
    p.add_argument("--shape", choices=SHAPES, default="tinyllama-1.1b",
                   help="the model's shape (default: %(default)s)")
    p.add_argument("--folder", type=Path, default=None,
                   help="where the random model is built, once (default: the cache folder's "
                   "models/SHAPE, ~2.3 GB for tinyllama-1.1b, 13 GB for llama-7b)")
    p.add_argument("--formats", type=format_list(FORMATS), default=["int4", "bfloat16"],
                   help="weight formats to run (default: int4,bfloat16)")
    p.add_argument("--threads", type=positive_int, default=2, help="CPU threads (default: 2)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="tokens decoded a run (default: %(default)s)")
    p.add_argument("--no-forwards", action="store_true",
                   help="skip the forwards of 1-8 rows (a process that loads the model again)")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR",
                   help="llama.cpp's source folder, built (build/bin/llama-bench, "
                   "llama-completion, llama-quantize): its GGUFs of the same weights measured "
                   "beside")
    p.add_argument("--convert-python", default=sys.executable,
                   help="the Python that runs convert_hf_to_gguf.py (it needs transformers; "
                   "default: this one)")
    p.add_argument("--profile", action="store_true",
                   help="also where each format's plain step goes: its products by shape on "
                   "one thread and on --threads, the rest of the forward, the memory's rate")
    p.add_argument("--isa", choices=("native", "avx2"), default="native",
                   help="avx2: run as a CPU with AVX2 and FMA alone does (most laptops'), on "
                   "any x86 CPU with them; native: this CPU's every feature (default)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args(argv)


@entry_point
def main(argv=None):
    args = parse_args(argv)
    if args.out is not None:
        check_writable(args.out, "--out")
    if args.isa == "avx2":
        os.environ.update(AVX2_ENVIRONMENT)  # this process's machine key, and its children's
    folder = args.folder or cache_root() / "models" / args.shape
    if not (folder / "config.json").is_file():
        print(f"building a random {args.shape} in {folder} ...", file=sys.stderr, flush=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        build_model(args.shape, folder)
    results = {"machine": machine_key(torch.device("cpu"), torch.bfloat16), "shape": args.shape,
               "file_gb": round(sum(f.stat().st_size for f in folder.glob("*.safetensors"))
                                / 1e9, 3), "threads": args.threads, "isa": args.isa, "formats": {}}
    for weight_format in args.formats:
        runs = [generate_run(folder, weight_format, args.threads, args.max_new_tokens)
                for _ in ("first", "later")]
        results["formats"][weight_format] = {"first": runs[0], "later": runs[1]}
        if not args.no_forwards:
            results["formats"][weight_format]["forward_ms"] = forward_ms(folder, weight_format,
                                                                         args.threads)
        if args.profile:
            results["formats"][weight_format]["profile"] = step_shapes(folder, weight_format,
                                                                       args.threads)
        print(f"{weight_format}: {json.dumps(results['formats'][weight_format])}",
              file=sys.stderr, flush=True)
    if args.llama_cpp is not None:
        for kind, gguf in gguf_files(args.llama_cpp, folder, args.convert_python).items():
            results[f"llama.cpp {kind}"] = llama_cpp_run(args.llama_cpp, gguf, args.threads,
                                                         args.max_new_tokens)
            print(f"llama.cpp {kind}: {json.dumps(results[f'llama.cpp {kind}'])}",
                  file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))
    if args.out is not None:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
