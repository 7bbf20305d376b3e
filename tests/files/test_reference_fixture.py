"""The real default model against an independent reference implementation (the fixture file):
logits, greedy continuations, tokenizer ids and the chat template."""
import pytest
import torch

from minimedusa.model import causal_mask
from minimedusa.decoding import plain_decode
from minimedusa.acceptance import Sampling
from minimedusa.files.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_folder(default_model_dir)


def test_logits_match_reference_top10_ids_and_values(smollm2, reference):
    device = smollm2.embed.weight.device
    for case in reference["logits"]["cases"]:
        ids = torch.tensor([case["ids"]], device=device)  # (1, T)
        T = ids.shape[1]
        with torch.inference_mode():
            logits, _ = smollm2(ids, torch.arange(T, device=device)[None],
                                causal_mask(0, T, device))  # (1, T, V)
        values, top_ids = logits[0].float().cpu().topk(10, dim=-1)  # (T, 10) each
        assert top_ids.tolist() == case["top_ids"], case["name"]
        torch.testing.assert_close(values, torch.tensor(case["top_values"]), atol=1e-3, rtol=0)
        torch.testing.assert_close(logits[0].float().cpu().logsumexp(-1),
                                   torch.tensor(case["logsumexp"]), atol=1e-3, rtol=0)


def test_greedy_decoding_reproduces_reference_continuations(smollm2, reference):
    n = reference["greedy"]["max_new_tokens"]
    eos = {smollm2.config.eos_token_id}
    for case in reference["greedy"]["cases"]:
        steps = plain_decode(smollm2, case["prompt_ids"], n, Sampling(), eos)
        assert [t for step in steps for t in step.tokens] == case["output_ids"], case["kind"]


def test_tokenizer_encodes_reference_ids_and_round_trips(tokenizer, reference):
    for case in reference["tokenizer"]["cases"]:
        ids = tokenizer.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert tokenizer.decode(ids) == case["text"]


def test_chat_template_renders_and_encodes_like_reference(tokenizer, reference):
    chat = reference["chat_template"]
    text = tokenizer.chat_prompt(chat["example_messages"])
    assert text == chat["example_rendered"]
    assert tokenizer.encode(text) == chat["example_ids"]
    for case in reference["greedy"]["cases"]:  # these use the default system prompt too
        assert tokenizer.encode(tokenizer.chat_prompt(case["messages"])) == case["prompt_ids"]
