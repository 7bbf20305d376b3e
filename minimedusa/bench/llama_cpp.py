"""llama.cpp beside this project in `bench`: what a user would otherwise run on a laptop.

Optional: only when `llama-cpp-python` is installed (pip install llama-cpp-python; never a
dependency of this project). It runs the GGUF file the default model was converted from (Q4_1:
4-bit weights in groups of 32 with a scale and a minimum each), greedily, with the benchmark's
threads, from the same prompt token ids, for exactly as many new tokens, its prompt's prefill
timed as ours is. Its output is not expected to equal ours: Q4_1 arithmetic is not float32's.
It runs in a process of its own (`python -m minimedusa.bench.llama_cpp GGUF`: a JSON line per
request and per reply, each timed inside it) because its native code can die: llama-cpp-python
0.3.36 built natively dies at `ldtilecfg` in ggml's AMX code on Intel AMX CPUs. Then one line
says so, with the build without AMX (NO_AMX_BUILD), and every other engine's results stay.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

from minimedusa.files.default_model import DEFAULT_MODEL_DIR, ensure_default_gguf
from minimedusa.cli.flags import Parser, positive_int

# llama-cpp-python built without ggml's AMX path (where it crashes), keeping the AVX-512 an AMX
# CPU has; --no-cache-dir: pip's wheel cache would reuse the native build, whatever CMAKE_ARGS
NO_AMX_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF '
                '-DGGML_AMX_BF16=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON '
                '-DGGML_AVX512_BF16=ON" pip install --no-cache-dir --force-reinstall --no-deps '
                'llama-cpp-python')


class EngineDied(RuntimeError):
    """llama.cpp's process died; the message is one line: how, and how to build it to run."""


def child_command(gguf: Path, threads: int, context: int) -> list[str]:
    """The command that starts llama.cpp's process (tests start a stand-in instead)."""
    return [sys.executable, "-m", "minimedusa.bench.llama_cpp", str(gguf),
            "--threads", str(threads), "--context", str(context)]


def llama_cpp_engine(gguf: Path, threads: int, context: int = 4096):
    """A bench engine: (prompt ids, n, seed) -> (n new token ids, seconds, steps = n), each
    answered by llama.cpp's process, started here and loaded before this returns (so that its
    loading overlaps nothing timed); it ends when the engine is dropped or this process exits."""
    child = subprocess.Popen(child_command(gguf, threads, context), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    if not child.stdout.readline():  # its "ready" line, once the model is loaded
        raise died(child)

    def run(prompt_ids: list[int], n: int, seed):
        try:
            print(json.dumps({"prompt": prompt_ids, "n": n}), file=child.stdin, flush=True)
            line = child.stdout.readline()
        except BrokenPipeError:  # it died before reading the request
            line = ""
        if not line:
            raise died(child)
        reply = json.loads(line)
        return reply["tokens"], reply["seconds"], n
    weakref.finalize(run, close, child)  # also at exit: no child left behind
    return run


def died(child: subprocess.Popen) -> EngineDied:
    """The one line for a child that stopped answering, once it has exited (no zombie)."""
    close(child)
    code = child.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    return EngineDied(f"llama.cpp's process died ({how}); where llama-cpp-python's native build "
                      f"crashes in ggml's AMX code (ldtilecfg), build it without: {NO_AMX_BUILD}")


def close(child: subprocess.Popen) -> None:
    """End llama.cpp's process: the end of its input ends its loop; then reap it."""
    try:
        child.stdin.close()
    except BrokenPipeError:  # a request it never read: it is gone already
        pass
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:  # stuck in native code: do not hang the benchmark
        child.kill()
        child.wait()
    child.stdout.close()


def load_llama_cpp(folder: Path, threads: int):
    """llama.cpp's engine on the default model's GGUF, or None (with a one-line reason) when
    llama-cpp-python is not installed, the model is not the default one, or it dies loading."""
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed: llama.cpp is left out of the comparison "
              "(pip install llama-cpp-python to compare)", file=sys.stderr)
        return None
    if Path(folder).resolve() != DEFAULT_MODEL_DIR.resolve():
        print("llama.cpp runs only the default model's GGUF: left out for --model",
              file=sys.stderr)
        return None
    try:
        return llama_cpp_engine(ensure_default_gguf(), threads)
    except EngineDied as e:
        print(f"llama.cpp is left out of the comparison: {e}", file=sys.stderr)
        return None


def generate(llm, prompt_ids: list[int], n: int) -> tuple[list[int], float]:
    """n new tokens, greedily, and the seconds from the prompt (its prefill timed) to the last."""
    llm.reset()  # no prefix reused from the last question: every prefill is timed
    start, out = time.perf_counter(), []
    for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)  # EOS does not stop it: n tokens, like every other engine
        if len(out) == n:
            break
    return out, time.perf_counter() - start


def main(argv=None):
    p = Parser(description="llama.cpp for `bench`, in a process of its own: loads a GGUF, says "
               '{"ready": true}, then answers each JSON line on stdin, {"prompt": [ids], "n": N}, '
               'with one on stdout, {"tokens": [N ids], "seconds": s}, until stdin ends.')
    p.prog = "python -m minimedusa.bench.llama_cpp"  # as typed (else argparse names the file)
    p.add_argument("gguf", type=Path, help="the GGUF file to run")
    p.add_argument("--threads", type=positive_int, required=True, help="llama.cpp's threads")
    p.add_argument("--context", type=positive_int, default=4096,
                   help="context length in tokens (default: %(default)s)")
    args = p.parse_args(argv)
    # note: the replies get stdout's own copy; anything else written to stdout (native code
    # included) goes to stderr instead, so that no stray line can be read as a reply
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the benchmark, which ends this
    from llama_cpp import Llama
    llm = Llama(model_path=str(args.gguf), n_ctx=args.context, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        tokens, seconds = generate(llm, request["prompt"], request["n"])
        print(json.dumps({"tokens": tokens, "seconds": seconds}), file=replies, flush=True)


if __name__ == "__main__":
    main()
