"""Streaming detokenization: the pieces, concatenated, are exactly the decoded text, even when
one character is split over several byte-level tokens; the model's own chat template renders the
chat, and a template that fails is one clear error."""
import pytest
from hypothesis import given, settings, strategies as st

from minimedusa.errors import UserError
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


def test_chat_without_system_turn_gets_the_templates_default_system_prompt(tokenizer):
    text = tokenizer.chat_prompt([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    own = tokenizer.chat_prompt([{"role": "system", "content": "X"},
                                 {"role": "user", "content": "Hi"}])
    assert "SmolLM" not in own
    assert tokenizer.user_turn_opening() == text[:text.index("Hi")]


def test_a_template_that_fails_or_is_missing_is_one_clear_error():
    raising = "{{ raise_exception('only user and assistant roles') }}"
    with pytest.raises(UserError, match="chat template failed to render: only user"):
        render_chat(raising, [{"role": "user", "content": "Hi"}], {})
    with pytest.raises(UserError, match="failed to render"):
        render_chat("{{ messages[0].content.__class__.__mro__ }}",  # the sandbox says no
                    [{"role": "user", "content": "Hi"}], {})
    with pytest.raises(UserError, match="no chat_template .* --raw"):
        Tokenizer(None, None, {}).chat_prompt([{"role": "user", "content": "Hi"}])
