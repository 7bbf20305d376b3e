"""Streaming detokenization: the pieces, concatenated, are exactly the decoded text, even when
one character is split over several byte-level tokens."""
import pytest
from hypothesis import given, settings, strategies as st

from minimedusa.tokenizer import StreamDecoder, Tokenizer, render_chat


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_folder(default_model_dir)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
       chunk=st.integers(1, 4))
def test_streamed_pieces_concatenate_to_the_decoded_text(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    stream = StreamDecoder(tokenizer)
    pieces = [stream.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(stream.flush())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special=True)


def test_emoji_split_over_tokens_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # byte-level BPE spreads it over several tokens
    stream = StreamDecoder(tokenizer)
    assert [stream.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🚀"]


def test_chat_without_system_turn_gets_the_default_system_prompt():
    text = render_chat([{"role": "user", "content": "Hi"}], "Be brief.")
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    assert text.endswith("<|im_start|>assistant\n")
    own = render_chat([{"role": "system", "content": "X"}, {"role": "user", "content": "Hi"}],
                      "Be brief.")
    assert "Be brief." not in own
