"""generate.py's flags: where the prompts come from, how they are rendered and decoded, the
heads, their tree and acceptance; parse_args checks the combinations that cannot run together
before anything loads (the rest: generate.check_flags, against the model as read)."""
from pathlib import Path

from minimedusa.cli.flags import (Parser, add_batch_argument, add_compile_argument,
                                  add_context_argument, add_device_arguments,
                                  add_draft_vocab_argument, add_quantize_argument,
                                  non_negative, positive_int, probability, seed_int)
from minimedusa.tree import NAMED_TREES


def add_input_arguments(p) -> None:
    """Where the prompts come from: --prompt, --prompts FILE, a chat, or standard input."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None,
                        help="the user's message (or raw text with --raw). Without --prompt, "
                        "--prompts or --chat: a chat on a terminal, else standard input's whole "
                        "text is the prompt (echo \"Hi\" | python generate.py)")
    source.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                        help="answer every prompt of FILE, loading the model once: one prompt a "
                        "line, or JSON lines whose objects all have a \"prompt\" (a message, or "
                        "a list of {\"role\", \"content\"} messages); writes a JSON line per "
                        "prompt (prompt, answer, tokens, steps, seconds)")
    source.add_argument("--chat", action="store_true",
                        help="a chat even where standard input is not a terminal (a script of "
                        "messages and commands, one a line). Its commands: /help, /exit, /reset, "
                        "/undo (the last exchange), /regen (the last answer), /save FILE, "
                        "/load FILE (JSON: a list of {\"role\", \"content\"}); Ctrl-C stops "
                        "an answer, keeping what came")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="with --prompts: write the answers to FILE (default: stdout)")
    add_batch_argument(p)
    p.add_argument("--when-full", choices=["drop-oldest", "reset"], default="drop-oldest",
                   help="a chat past the model's context: drop the oldest exchanges (default) "
                   "or start over from the last message")


def add_prompt_arguments(p) -> None:
    p.add_argument("--raw", action="store_true",
                   help="feed the prompt as is, without the chat template")
    p.add_argument("--system", default=None,
                   help="system message (default: the model's own default system prompt)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="stop after this many new tokens (default: %(default)s)")
    p.add_argument("--temperature", type=non_negative, default=0.0,
                   help="0 = greedy (default); > 0 samples from softmax(logits / T)")
    p.add_argument("--top-p", type=probability, default=1.0,
                   help="nucleus sampling: keep the smallest token set with this much "
                   "probability (default: %(default)s = off)")
    p.add_argument("--seed", type=seed_int, default=None, help="seed for sampling (default: random)")
    p.add_argument("--model", type=Path, default=None,
                   help="an HF Llama folder with config.json, *.safetensors and tokenizer.json "
                   "(default: weights/SmolLM2-135M-Instruct, fetched and converted on first use)")


def add_medusa_arguments(p) -> None:
    p.add_argument("--heads", default=None,
                   help="Medusa heads folder (config.json + medusa_lm_head.safetensors; "
                   "default: the trained heads in weights/ for the default model, none for "
                   "--model); "
                   "'untrained:K' / 'untrained-shared:K' / 'untrained-hydra:K' make K heads in "
                   "the paper's initialisation, own / shared projection / Hydra's (they only "
                   "guess repeats: for trying the machinery, not for speed)")
    add_draft_vocab_argument(p)
    add_context_argument(p)
    p.add_argument("--tree", default=None,
                   help=f"candidate tree: {', '.join(NAMED_TREES)}, dense:s1,s2,... (top-s_k "
                   "of head k), or a JSON file of node paths, used for every step; or ranked:N, "
                   "each step's N nodes of highest path probability under the heads, or ranked, "
                   "N chosen step by step as the default tree's size is (default: "
                   "the tree grown from the heads' calibration, its size chosen step by step "
                   "from step latencies measured on this machine, plain steps included)")
    p.add_argument("--acceptance", choices=["auto", "greedy", "typical", "rejection",
                                             "speculative"],
                   default="auto", help="how candidates are verified (default: auto = greedy "
                   "at temperature 0; above it, lossless speculative sampling of candidates "
                   "drawn from the heads (speculative_sampling.py), or with --tree ranked "
                   "rejection sampling of their top guesses (also lossless); typical: faster, "
                   "not lossless)")
    p.add_argument("--eps", type=non_negative, default=0.09,
                   help="typical acceptance: hard threshold epsilon (default: %(default)s)")
    p.add_argument("--delta", type=non_negative, default=0.3,
                   help="typical acceptance: entropy-scaled threshold delta "
                   "(default: %(default)s)")
    p.add_argument("--draft", default=None, metavar="FORMAT_OR_DIR",
                   help="speculative decoding with a draft model: the model rounded (int4, "
                   "w4a8, int8: on a CPU) drafts, the model in --dtype (default float32 with "
                   "--draft) verifies its drafts in one forward a round and writes its own "
                   "text, exactly (greedy) or in law (sampling); or another model folder with "
                   "the same tokenizer drafts. Greedy, the draft decodes with heads (--heads, "
                   "else the default model's own): Medusa inside the draft "
                   "(speculative_decoding.py)")
    p.add_argument("--baseline", action="store_true",
                   help="plain decoding, one token per forward, even if heads are given (with "
                   "--draft: the draft drafts a token a forward)")


def parse_args(argv=None):
    p = Parser(description="Generate text with a Llama (default: SmolLM2-135M-Instruct, "
               "fetched and converted into weights/ on first use): a chat, one prompt or a file "
               "of them.")
    add_input_arguments(p)
    add_prompt_arguments(p)
    add_device_arguments(p)
    add_quantize_argument(p)
    add_compile_argument(p)
    add_medusa_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ids, text, timing) instead of streaming text "
                   "(one prompt)")
    args = p.parse_args(argv)
    if args.out is not None and args.prompts is None:
        p.error("--out writes the answers of --prompts FILE")
    if args.batch is not None and args.prompts is None:
        p.error("--batch answers the prompts of --prompts FILE several at a time")
    if args.draft is not None:
        if args.quantize != "none":
            p.error(f"--draft verifies with the model in --dtype (default float32) and drafts "
                    f"with it rounded; --quantize {args.quantize} would round the verifier too")
    if args.json and (args.prompts is not None or args.chat):
        p.error("--json prints one prompt's answer (--prompts writes JSON lines already)")
    return args
