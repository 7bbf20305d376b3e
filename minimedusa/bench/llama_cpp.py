"""llama.cpp beside this project in `bench`: what a user would otherwise run on a laptop.

Optional: only when `llama-cpp-python` is installed (pip install llama-cpp-python; never a
dependency of this project). It runs the GGUF file the default model was converted from (Q4_1:
4-bit weights in groups of 32 with a scale and a minimum each), greedily, with the benchmark's
threads, from the same prompt token ids, for exactly as many new tokens, its prompt's prefill
timed as ours is. Its output is not expected to equal ours: Q4_1 arithmetic is not float32's.
"""
import importlib.util
import sys
import time
from pathlib import Path

from minimedusa.files.default_model import DEFAULT_MODEL_DIR, ensure_default_gguf


def llama_cpp_engine(gguf: Path, threads: int, context: int = 4096):
    """A bench engine: (prompt ids, n, seed) -> (n new token ids, seconds, steps = n)."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                verbose=False)

    def run(prompt_ids: list[int], n: int, seed):
        llm.reset()  # no prefix reused from the last question: every prefill is timed
        start, out = time.perf_counter(), []
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)  # EOS does not stop it: n tokens, like every other engine
            if len(out) == n:
                break
        return out, time.perf_counter() - start, n
    return run


def load_llama_cpp(folder: Path, threads: int):
    """llama.cpp's engine on the default model's GGUF, or None (with a one-line reason) when
    llama-cpp-python is not installed or the model is not the default one."""
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed: llama.cpp is left out of the comparison "
              "(pip install llama-cpp-python to compare)", file=sys.stderr)
        return None
    if Path(folder).resolve() != DEFAULT_MODEL_DIR.resolve():
        print("llama.cpp runs only the default model's GGUF: left out for --model",
              file=sys.stderr)
        return None
    return llama_cpp_engine(ensure_default_gguf(), threads)
