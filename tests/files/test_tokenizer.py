"""Streaming detokenization: the pieces, concatenated, are exactly the decoded text, even when
one character is split over several byte-level tokens; the model's own chat template renders the
chat, the real Llama 3, Qwen2.5 and Mistral templates exactly as transformers renders them
(goldens made by tests/fixtures/chat_templates/make_renderings.py), and a template that fails is
one clear error."""
import json
from datetime import datetime

import pytest
from hypothesis import given, settings, strategies as st

from minimedusa.errors import UserError
from minimedusa.files.tokenizer import StreamDecoder, Tokenizer, render_chat
from helpers import REPO

TEMPLATES = REPO / "tests" / "fixtures" / "chat_templates"
GOLDEN = json.loads((TEMPLATES / "renderings.json").read_text())["renderings"]
RENDERED = [case for case in GOLDEN if "text" in case]
REFUSED = [case for case in GOLDEN if "error" in case]


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def case_name(case: dict) -> str:
    return f"{case['template']}: {case['conversation']}"


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
    with pytest.raises(UserError, match="failed to render: No filter named 'no_such_filter'"):
        render_chat("{{ messages | no_such_filter }}", [{"role": "user", "content": "Hi"}], {})
    with pytest.raises(UserError, match="no chat_template .* --raw"):
        Tokenizer(None, None, {}).chat_prompt([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("case", RENDERED, ids=case_name)
def test_real_templates_render_as_transformers_renders_them(tokenizer, case):
    text = render_chat(template(case["template"]), case["messages"], case["variables"])
    assert text == case["text"]  # char for char ...
    assert tokenizer.encode(text) == case["ids"]  # ... and token for token (transformers' ids)


@pytest.mark.parametrize("case", REFUSED, ids=case_name)
def test_a_conversation_the_template_refuses_is_its_own_message_in_one_error(case):
    with pytest.raises(UserError) as refused:
        render_chat(template(case["template"]), case["messages"], case["variables"])
    assert str(refused.value) == "the model's chat template failed to render: " + case["error"]


def test_llama_3_2_without_a_date_string_writes_todays_date():
    """The goldens pass date_string; without it the template calls strftime_now."""
    case = next(c for c in RENDERED if c["template"] == "llama-3.2-3b-instruct")
    variables = {k: v for k, v in case["variables"].items() if k != "date_string"}
    days = {datetime.now().strftime("%d %b %Y")}
    text = render_chat(template(case["template"]), case["messages"], variables)
    days.add(datetime.now().strftime("%d %b %Y"))  # in case it rendered across midnight
    fixed = "Today Date: " + case["variables"]["date_string"]
    assert text in {case["text"].replace(fixed, f"Today Date: {day}") for day in days}


def test_tojson_keeps_key_order_and_characters_as_transformers_does():
    # jinja2's own tojson would give {"a": [1], "b": "Z\\u00fcrich \\u003c\\u0026\\u003e ..."}
    text = render_chat("{{ v | tojson }}", [], {"v": {"b": "Zürich <&> it's", "a": [1]}})
    assert text == '{"b": "Zürich <&> it\'s", "a": [1]}'
    assert render_chat("{{ v | tojson(indent=1) }}", [], {"v": {"a": 1}}) == '{\n "a": 1\n}'
