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
    source.add_argument("--prompt", default=None, help="the user's message (default: standard "
                        "input's text; on a terminal, a chat)")
    source.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                        help="answer each prompt of FILE (a line each, or JSON lines with a "
                        "\"prompt\"), a JSON line an answer")
    source.add_argument("--chat", action="store_true",
                        help="a chat, also from a script on standard input (/help: commands)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="with --prompts: the answers' file (default: stdout); a stopped run "
                   "resumes")
    add_batch_argument(p)
    p.add_argument("--when-full", choices=["drop-oldest", "reset"], default="drop-oldest",
                   help="a chat past the context: drop the oldest exchanges (default) or reset")


def add_prompt_arguments(p) -> None:
    p.add_argument("--raw", action="store_true", help="the prompt as is, without the chat "
                   "template")
    p.add_argument("--system", default=None, help="system message (default: the model's own)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="stop after this many new tokens (default: %(default)s)")
    p.add_argument("--temperature", type=non_negative, default=0.0,
                   help="0: greedy (default); above: sampling, lossless")
    p.add_argument("--top-p", type=probability, default=1.0,
                   help="nucleus sampling's mass (default: %(default)s, off)")
    p.add_argument("--seed", type=seed_int, default=None, help="sampling's seed (default: "
                   "random)")
    p.add_argument("--model", type=Path, default=None,
                   help="an HF Llama folder (default: weights/SmolLM2-135M-Instruct)")


def add_medusa_arguments(p) -> None:
    p.add_argument("--heads", default=None,
                   help="Medusa heads folder, or untrained:K (default: the default model's "
                   "trained heads)")
    add_draft_vocab_argument(p)
    add_context_argument(p)
    p.add_argument("--tree", default=None,
                   help=f"a fixed tree ({', '.join(NAMED_TREES)}, dense:s1,s2,..., a JSON "
                   "file), ranked[:N] (default: grown, its size adapted)")
    p.add_argument("--acceptance", choices=["auto", "greedy", "typical", "rejection",
                                             "speculative"], default="auto",
                   help="how candidates are verified (default: greedy at T=0, else "
                   "speculative sampling)")
    p.add_argument("--eps", type=non_negative, default=0.09,
                   help="typical acceptance's epsilon (default: %(default)s)")
    p.add_argument("--delta", type=non_negative, default=0.3,
                   help="typical acceptance's delta (default: %(default)s)")
    p.add_argument("--draft", default=None, metavar="FORMAT_OR_DIR",
                   help="speculative decoding: the model rounded (int4, w4a8, int8) or another "
                   "folder drafts, the model in --dtype verifies")
    p.add_argument("--baseline", action="store_true",
                   help="plain decoding, a token a forward (with --draft: plain drafts)")


def parse_args(argv=None):
    p = Parser(description="Generate text with a Llama (default: SmolLM2-135M-Instruct) and "
               "Medusa's heads: a chat, a prompt or a file of them. README's Flags: the why.")
    add_input_arguments(p)
    add_prompt_arguments(p)
    add_device_arguments(p)
    add_quantize_argument(p)
    add_compile_argument(p)
    add_medusa_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="one prompt's answer as a JSON object (ids, text, timing)")
    p.add_argument("--show", action="store_true",
                   help="colour each token by what guessed it: a head, a context candidate, "
                   "the draft model (on a terminal)")
    p.add_argument("--trace", type=Path, metavar="FILE.html",
                   help="write a page of every step's tree, candidates and verdict (one prompt)")
    args = p.parse_args(argv)
    if args.out is not None and args.prompts is None:
        p.error("--out writes the answers of --prompts FILE")
    if args.batch is not None and args.prompts is None:
        p.error("--batch answers the prompts of --prompts FILE several at a time")
    if args.draft is not None:
        if args.quantize != "none":
            p.error(f"--draft verifies with the model in --dtype (default float32) and drafts "
                    f"with it rounded; --quantize {args.quantize} would round the verifier too")
    if args.show and (args.prompts is not None or args.json):
        p.error("--show colours a streamed answer; --prompts and --json write JSON")
    if args.trace is not None and (args.prompts is not None or args.chat or args.baseline):
        p.error("--trace draws one prompt's Medusa steps: give --prompt TEXT, without --baseline")
    if args.json and (args.prompts is not None or args.chat):
        p.error("--json prints one prompt's answer (--prompts writes JSON lines already)")
    return args
