"""Text <-> token ids: byte-level BPE (the `tokenizers` library), the ChatML chat template in
plain Python, and a streaming decoder that turns ids into text as they are accepted.

SmolLM2's pre-tokenizer splits every digit on its own before GPT-2's byte-level split; the BPE
itself comes from the GGUF's vocabulary and merges. Left out: jinja (the template is ChatML,
written out below) and tokenizers other than byte-level BPE.
"""
import json
import re
from pathlib import Path

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from minimedusa.errors import UserError

# The ChatML frame every turn is wrapped in, and the marker an assistant turn starts with.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SYSTEM_IN_TEMPLATE = re.compile(re.escape(IM_START) + r"system\n(.*?)" + re.escape(IM_END), re.S)


def byte_level_bpe(tokens: list[str], merges: list[str], special_ids: list[int]) -> HFTokenizer:
    """SmolLM2's tokenizer from a vocabulary (id -> token) and merges ("a b" strings).

    Special tokens (<|im_start|>, ...) are matched whole in the text, never split by BPE.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i in special_ids])
    return tk


def render_chat(messages: list[dict], default_system: str | None) -> str:
    """ChatML, as SmolLM2's template renders it with add_generation_prompt=True.

    >>> render_chat([{"role": "user", "content": "Hi"}], "Be nice.")
    '<|im_start|>system\\nBe nice.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
    """
    turns = []
    if messages and messages[0]["role"] != "system" and default_system is not None:
        turns.append({"role": "system", "content": default_system})
    turns += messages
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in turns)
    return text + f"{IM_START}assistant\n"


class Tokenizer:
    def __init__(self, tk: HFTokenizer, chat_template: str | None):
        self.tk = tk
        self.chat_template = chat_template  # the jinja source, kept only to read it (below)

    @classmethod
    def from_folder(cls, folder) -> "Tokenizer":
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise UserError(f"no tokenizer.json in {folder}")
        config = folder / "tokenizer_config.json"
        template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
        return cls(HFTokenizer.from_file(str(folder / "tokenizer.json")), template)

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special)

    def default_system_prompt(self) -> str | None:
        """The system turn the template inserts when the chat has none (SmolLM2 has one)."""
        match = SYSTEM_IN_TEMPLATE.search(self.chat_template or "")
        return match.group(1) if match else None

    def chat_prompt(self, messages: list[dict]) -> str:
        if self.chat_template is None or IM_START not in self.chat_template:
            raise UserError("this model has no ChatML chat template; pass the prompt with --raw")
        return render_chat(messages, self.default_system_prompt())

    def user_turn_opening(self) -> str:
        """The chat up to where a user's words begin (system turn, then `<|im_start|>user\n`):
        what the model continues when it writes a user turn itself."""
        text = self.chat_prompt([{"role": "user", "content": ""}])
        return text[:text.rindex(f"{IM_END}\n{IM_START}assistant\n")]


class StreamDecoder:
    """Text pieces from token ids as they arrive, decoding only a small window each time.

    Re-decoding the whole output every step would be quadratic. Byte-level BPE can split one
    UTF-8 character over several tokens, so a piece whose decoding ends in U+FFFD (an
    incomplete character) is held back until the next tokens complete it.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window decoded each time begins here ...
        self.done = 0  # ... and its text up to here has been emitted already

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.unemitted()
        if text.endswith("\ufffd"):
            return ""
        self.start, self.done = self.done, len(self.ids)
        return text

    def flush(self) -> str:
        """Whatever is still held back when the output ends (bytes that never became valid
        UTF-8 are shown as U+FFFD, as the full decode shows them)."""
        text = self.unemitted()
        self.start = self.done = len(self.ids)
        return text

    def unemitted(self) -> str:
        """The text of the tokens after `done`. The window starts at the previous emission,
        not at `done`, so that a character whose bytes straddle `done` decodes whole."""
        emitted = self.tokenizer.decode(self.ids[self.start:self.done], skip_special=True)
        window = self.tokenizer.decode(self.ids[self.start:], skip_special=True)
        return window[len(emitted):]
