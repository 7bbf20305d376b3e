"""A GPU session's measurements in one command: a GPU is lent for minutes, so everything it
should measure is prepared (and tried on a CPU, --device cpu --quick) before it starts.

    python -m minimedusa.bench.gpu_session --out DIR                  # every step, on CUDA
    python -m minimedusa.bench.gpu_session --out DIR --steps tests    # some of them
    python -m minimedusa.bench.gpu_session --out /tmp/s --device cpu --quick   # tried here

Each step runs as a process of its own under its own time limit, writing its output into DIR
as it goes, so that a session cut short still brings back what it did. In the order they run
(the acceptance's numbers first):
0. reference: the reference check of CUDA's paths (tests/test_reference_paths.py: bfloat16
   eager and in graphs of the compiled blocks against the CPU's eager float32 on the default
   model; every bench below also holds each greedy engine to eager bfloat16's text);
1. tests: the CUDA graphs' tests (tests/test_cuda_graphs.py, run on CUDA where present);
2. compiled: bench in bfloat16 with compiled blocks inside the CUDA graphs (--compile, the
   default on CUDA): plain decoding and Medusa greedy (the Budget's trees, context candidates);
3. batch: bench --batch 1,4,16 (many prompts at once, each batch size's step in graphs);
4. profile: bench --profile of the compiled graphs (kernels and GPU time a step, steps by
   tree size);
5. sampling: the graphed step's sampling engines at T = 0.7 (rejection, speculative sampling,
   typical acceptance);
6. eager: plain and Medusa greedy in graphs and eager (--eager-too): how much the graphs give.
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def steps(args) -> dict[str, tuple[int, list[str], str]]:
    """{name: (time limit in seconds, command, the file its output goes to)}."""
    base = [sys.executable, "-m", "minimedusa.bench", "--device", args.device,
            "--no-transformers", "--no-llama-cpp",
            "--dtype", "bfloat16" if args.device == "cuda" else "float32"]
    if args.quick:
        base += ["--max-new-tokens", "16"]
    if args.questions is not None:
        base += ["--questions", str(args.questions)]

    def bench(per_category: int, *flags: str) -> list[str]:
        return [*base, "--per-category", str(per_category), *flags]
    out = args.out
    return {
        "reference": (300, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                            "cuda or broken or falls_back",
                            str(REPO / "tests" / "test_reference_paths.py")],
                      "tests-reference-paths-cuda.txt"),
        "tests": (240, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(REPO / "tests" / "test_cuda_graphs.py")], "tests-cuda-graphs.txt"),
        "compiled": (200, bench(1, "--compile", "--no-sampling",
                                "--out", str(out / "bench-cuda-compiled.json")),
                     "bench-cuda-compiled.txt"),
        "batch": (200, bench(2, "--batch", "1,4,16", "--rounds", "1",
                             "--out", str(out / "bench-cuda-batch.json")),
                  "bench-cuda-batch.txt"),
        "profile": (120, bench(1, "--profile", "--compile"), "profile-step-cuda-compiled.txt"),
        "sampling": (200, bench(1, "--temperature", "0.7",
                                "--out", str(out / "bench-cuda-sampling.json")),
                     "bench-cuda-sampling.txt"),
        "eager": (200, bench(1, "--eager-too", "--no-sampling",
                             "--out", str(out / "bench-cuda-eager.json")),
                  "bench-cuda-eager.txt"),
    }


def run_step(name: str, limit: int, command: list[str], log: Path) -> None:
    """One step, its output into `log` as it comes; a step past its limit is stopped (what
    it wrote stays), and the next runs."""
    print(f"== {name} (at most {limit} s): {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        try:
            done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=limit,
                                  cwd=REPO)
            status = f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            status = f"stopped at its limit of {limit} s"
        f.write(f"\n== {name}: {status} after {time.perf_counter() - start:.0f} s\n")
    print(f"== {name}: {status} after {time.perf_counter() - start:.0f} s", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m minimedusa.bench.gpu_session",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the folder the records go to")
    p.add_argument("--steps", default="reference,tests,compiled,batch,profile,sampling,eager",
                   help="which steps, in this order (default: %(default)s)")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the steps")
    p.add_argument("--questions", type=Path, default=None,
                   help="MT-Bench's questions (default: bench's)")
    p.add_argument("--quick", action="store_true", help="16 new tokens a question")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    table = steps(args)
    for name in args.steps.split(","):
        if name not in table:
            p.error(f"unknown step {name!r}: choose among {', '.join(table)}")
    for name in args.steps.split(","):
        limit, command, log = table[name]
        run_step(name, limit, command, args.out / log)


if __name__ == "__main__":
    main()
