"""A conversation, not one prompt: `python generate.py` as a chat (cli/chat.py), a prompt from
standard input and a file of prompts (cli/prompts.py), and what they rest on in the core: a
conversation continued in its KV cache decodes as fresh runs given the whole history do, each
turn prefilling only its new tokens.

The chats run generate.main in-process on a tiny random Llama with the real tokenizer, their
messages scripted through a monkeypatched stdin; the real default model checks the same once."""
import io
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

import generate
from helpers import cached_keys_values, copycat_model, model_folder, tiny_model
from minimedusa import decoding
from minimedusa.acceptance import Sampling, greedy
from minimedusa.budget import fixed
from minimedusa.assembly.recipe import wrapped
from minimedusa.decoding import decode_step, medusa_decode, plain_decode, prefill
from minimedusa.experiments.draft_layer import HydraPlusPlusHeads
from minimedusa.errors import UserError
from minimedusa.cli.chat import COMMANDS
from minimedusa.heads import HydraHeads
from minimedusa.kv_cache import KVCache
from minimedusa.speed.packed_linear import ONEDNN_LINEAR
from minimedusa.speed.weight_formats import apply_format, format_named
from minimedusa.tree import build_tree

# eager steps (what is checked here is not the compiled step) and float32 whatever the CPU
FAST = ["--no-compile", "--dtype", "float32", "--max-new-tokens", "8"]
MEDUSA = ["--heads", "untrained-hydra:3", "--tree", "chain3"]
MODES = {"plain": ["--baseline"], "medusa": MEDUSA}
CHAIN = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]


def flat(steps) -> list[int]:
    return [t for step in steps for t in step.tokens]


# --- the core: a conversation in the caller's cache --------------------------------------------

@pytest.mark.skipif(not ONEDNN_LINEAR, reason="this torch build has no oneDNN linear")
def test_a_prompts_rows_are_the_same_bits_however_it_is_split():
    """prefill runs at most EXACT_ATTENTION_TOKENS rows a forward (never SDPA): a 600-token
    prompt prefilled at once, in two calls, or with its last token as a decoding step gives the
    same logits, hidden states, keys and values, to the bit (prepacked float32 products: the
    decoding's own; torch's float64 products round by the row count)."""
    model = apply_format(tiny_model(0, dtype=torch.float32, max_position_embeddings=1024),
                         format_named("float32"))
    prompt = torch.randint(0, 64, (1, 600), generator=torch.Generator().manual_seed(0))
    whole, parts, stepped = (KVCache.for_model(model, 600) for _ in range(3))
    logits, hidden = prefill(model, whole, prompt)
    prefill(model, parts, prompt[:, :100])
    logits_parts, hidden_parts = prefill(model, parts, prompt[:, 100:])
    prefill(model, stepped, prompt[:, :599])
    logits_step, _ = decode_step(model, stepped, prompt[:, 599:])
    assert torch.equal(logits, logits_parts) and torch.equal(logits, logits_step)
    assert torch.equal(hidden[100:], hidden_parts)
    for cache in (parts, stepped):
        assert cache.length == 600
        for a, b in zip(cached_keys_values(whole, 600), cached_keys_values(cache, 600)):
            assert torch.equal(a, b)


def conversation_decoder(kind: str, model, heads, tree, max_new: int, stop: set[int]):
    if kind == "plain":
        return lambda ids, cache=None: plain_decode(model, ids, max_new, Sampling(), stop, cache)
    draft, budget = fixed(heads, tree)
    draft = wrapped(draft, heads, False)  # Hydra++ heads read through their draft layer
    return lambda ids, cache=None: medusa_decode(model, draft, budget, greedy(), ids, max_new,
                                                 stop, cache)


@pytest.mark.parametrize("kind", ["plain", "medusa"])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), repetitive=st.sampled_from([None, 2.0, 10.0]),
       turns=st.lists(st.lists(st.integers(0, 63), min_size=1, max_size=6), min_size=2,
                      max_size=4),
       max_new=st.integers(1, 12))
def test_a_conversation_continued_in_its_cache_decodes_as_fresh_runs(kind, seed, repetitive,
                                                                      turns, max_new):
    """Each turn appends the user's tokens to the history and decodes in the cache that holds
    the conversation so far: its answer == a fresh run's on the whole history, and the cache
    then holds the history and the answer but its last token (a Medusa step's tokens past a
    stop are dropped), as a prefill of those tokens would. Copycat models too, so that Medusa
    steps accept several tokens."""
    model = tiny_model(seed) if repetitive is None else copycat_model(seed, repetitive)
    heads = HydraHeads.for_model(model, 4).eval()
    decode = conversation_decoder(kind, model, heads, build_tree(CHAIN, num_heads=4), max_new,
                                  {seed % 64})
    cache = KVCache.for_model(model, model.config.max_position_embeddings + len(CHAIN) + 1)
    history = []
    for user in turns:
        history += user
        answer = flat(decode(history, cache))
        assert answer == flat(decode(history))
        history += answer
        held = len(history) - 1
        assert cache.length == held
        prefilled = KVCache.for_model(model, held)
        prefill(model, prefilled, torch.tensor([history[:-1]]))
        for a, b in zip(cached_keys_values(cache, held), cached_keys_values(prefilled, held)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_hydra_plus_plus_heads_cannot_continue_a_conversation():
    """Their draft layer's own cache is not kept between runs: one clear error, no wrong
    answer."""
    model = tiny_model(0)
    heads = HydraPlusPlusHeads.for_model(model, 2).eval()
    decode = conversation_decoder("medusa", model, heads, build_tree(CHAIN[:2], num_heads=2),
                                  4, set())
    cache = KVCache.for_model(model, 64)
    flat(decode([1, 2, 3], cache))  # a first turn: an empty cache is a fresh one
    with pytest.raises(UserError, match="Hydra\\+\\+ heads cannot continue a conversation"):
        flat(decode([1, 2, 3, 4, 5, 6, 7], cache))


# --- the chat, through generate.main -----------------------------------------------------------

@pytest.fixture
def runs(monkeypatch):
    """Every decoding run generate.py starts, as {"prompt": ids, "answer": ids, "kept": tokens
    already in the cache, "prefilled": tokens decoding.prefill ran}; "loads": loadings."""
    runs, real_decoder, real_prefill, real_load = [], generate.decoder, prefill, generate.load

    def decoder(args, model, recipe, draft=None):
        chosen = real_decoder(args, model, recipe, draft)
        real_decode = chosen.decode

        def decode(ids, n, stop_ids, cache=None):
            run = {"prompt": list(ids), "answer": [], "prefilled": 0,
                   "kept": 0 if cache is None else cache.length}
            runs.append(run)
            for step in real_decode(ids, n, stop_ids, cache):
                run["answer"] += step.tokens
                yield step
        chosen.decode = decode
        return chosen

    def counted_prefill(model, cache, prompt):
        runs[-1]["prefilled"] += prompt.shape[1]
        return real_prefill(model, cache, prompt)

    def load(args):
        loads.append(args)
        return real_load(args)
    loads = []
    monkeypatch.setattr(generate, "decoder", decoder)
    monkeypatch.setattr(decoding, "prefill", counted_prefill)
    monkeypatch.setattr(generate, "load", load)
    return runs, loads


def run_main(monkeypatch, capsys, args: list[str], stdin: str = "") -> tuple[str, str]:
    """generate.main(args) with `stdin` as standard input (not a terminal): (stdout, stderr)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    generate.main([str(a) for a in args])
    return capsys.readouterr()


def chat(monkeypatch, capsys, folder, script: list[str], *flags) -> tuple[str, str]:
    return run_main(monkeypatch, capsys, ["--model", folder, "--chat", *FAST, *flags],
                    "".join(line + "\n" for line in script))


def fresh_answers(monkeypatch, capsys, tmp_path, folder, histories, *flags) -> list[dict]:
    """The runs of generate.py --prompts over JSON lines, each a whole history to answer."""
    path = tmp_path / "histories.jsonl"
    path.write_text("".join(json.dumps({"prompt": h}) + "\n" for h in histories))
    out, _ = run_main(monkeypatch, capsys, ["--model", folder, "--prompts", path, "--batch", "1",
                                         *FAST, *flags])
    return [json.loads(line) for line in out.splitlines()]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summaries(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[")]


@pytest.mark.parametrize("mode", MODES)
def test_each_turn_answers_as_a_fresh_run_on_the_whole_history_prefilling_only_new_tokens(
        mode, chat_folder, runs, tmp_path, monkeypatch, capsys):
    runs, _ = runs
    saved = tmp_path / "chat.json"
    out, err = chat(monkeypatch, capsys, chat_folder,
                    ["Hello there", "What is 2 + 2?", "Tell me a story", f"/save {saved}"],
                    *MODES[mode])
    turns = runs[:]
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert out == "".join(m["content"] + "\n" for m in messages[1::2])  # streamed, whole
    runs.clear()
    fresh = fresh_answers(monkeypatch, capsys, tmp_path, chat_folder,
                          [messages[:1], messages[:3], messages[:5]], *MODES[mode])
    assert [r["prompt"] for r in runs] == [t["prompt"] for t in turns]
    assert [r["answer"] for r in runs] == [t["answer"] for t in turns]
    assert [f["answer"] for f in fresh] == [m["content"] for m in messages[1::2]]
    cached, before = [], []  # the tokens the cache held after the turn before; its prompt
    for turn, line in zip(turns, summaries(err), strict=True):
        # the cache keeps all it shares with the new rendering (at least the turn before's
        # prompt: the template only appends; the random model's answers do not always encode
        # back into the tokens it generated), and the turn prefills the rest, no more
        assert turn["kept"] == common_prefix(cached, turn["prompt"]) >= len(before)
        assert turn["prefilled"] == len(turn["prompt"]) - turn["kept"]
        assert (f"(prefilled {turn['prefilled']} new tokens, {turn['kept']} kept in the cache)"
                in line)
        cached, before = turn["prompt"] + turn["answer"][:-1], turn["prompt"]


def test_undo_removes_the_last_exchange(chat_folder, runs, tmp_path, monkeypatch, capsys):
    runs, _ = runs
    saved = tmp_path / "chat.json"
    _, err = chat(monkeypatch, capsys, chat_folder,
                  ["Hello", "Something to forget", "/undo", "What is 2 + 2?", f"/save {saved}"])
    messages = json.loads(saved.read_text())
    assert [m["content"] for m in messages[::2]] == ["Hello", "What is 2 + 2?"]
    assert "your last message and its answer are removed" in err
    [fresh] = fresh_answers(monkeypatch, capsys, tmp_path, chat_folder, [messages[:3]])
    assert fresh["answer"] == messages[3]["content"]


def test_regen_answers_the_last_message_again_prefilling_one_token(chat_folder, runs, tmp_path,
                                                                     monkeypatch, capsys):
    runs, _ = runs
    saved = tmp_path / "chat.json"
    chat(monkeypatch, capsys, chat_folder, ["Hello", "/regen", f"/save {saved}"])
    assert runs[1]["answer"] == runs[0]["answer"]  # greedy: the same answer
    assert len(json.loads(saved.read_text())) == 2  # the answer replaced, not added
    assert runs[1]["prompt"] == runs[0]["prompt"] and runs[1]["prefilled"] == 1


def test_reset_starts_over(chat_folder, runs, tmp_path, monkeypatch, capsys):
    runs, _ = runs
    saved = tmp_path / "chat.json"
    _, err = chat(monkeypatch, capsys, chat_folder,
                  ["Hello", "/reset", "What is 2 + 2?", f"/save {saved}"])
    assert [m["content"] for m in json.loads(saved.read_text())][:1] == ["What is 2 + 2?"]
    assert "the conversation starts over" in err
    chat(monkeypatch, capsys, chat_folder, ["What is 2 + 2?"])  # a chat of its own
    assert runs[1]["prompt"] == runs[2]["prompt"] and runs[1]["answer"] == runs[2]["answer"]


def test_a_saved_conversation_loads_and_goes_on_as_if_never_left(chat_folder, runs, tmp_path,
                                                                 monkeypatch, capsys):
    runs, _ = runs
    saved, again = tmp_path / "chat.json", tmp_path / "again.json"
    chat(monkeypatch, capsys, chat_folder, ["Hello", "What is 2 + 2?", f"/save {saved}"])
    _, err = chat(monkeypatch, capsys, chat_folder,
                  [f"/load {saved}", "Tell me a story", f"/save {again}"])
    assert "4 messages loaded from" in err
    chat(monkeypatch, capsys, chat_folder, ["Hello", "What is 2 + 2?", "Tell me a story"])
    loaded, whole = runs[2], runs[5]
    assert loaded["prompt"] == whole["prompt"] and loaded["answer"] == whole["answer"]
    assert json.loads(again.read_text())[:4] == json.loads(saved.read_text())


@pytest.mark.parametrize("content, needle", [
    ("not json", "cannot load"),
    ('[{"role": "user"}]', "not a list of messages"),
    ('{"role": "user", "content": "Hi"}', "not a list of messages"),
    ('"Hi"', "not a list of messages"),
])
def test_a_bad_conversation_file_is_one_line_and_the_chat_goes_on(
        content, needle, chat_folder, runs, tmp_path, monkeypatch, capsys):
    runs, _ = runs
    (tmp_path / "bad.json").write_text(content)
    _, err = chat(monkeypatch, capsys, chat_folder,
                  [f"/load {tmp_path / 'bad.json'}", "/load", "Hello"])
    [line] = [line for line in err.splitlines() if "cannot load" in line]
    assert needle in line
    assert "/load needs a file name" in err
    assert len(runs) == 1 and runs[0]["kept"] == 0


def test_help_lists_the_commands_and_exit_ends_the_chat(chat_folder, runs, monkeypatch, capsys):
    runs, _ = runs
    out, err = chat(monkeypatch, capsys, chat_folder, ["/help", "/nonsense", "/exit", "Hello"])
    for name in COMMANDS:
        assert name in err
    assert "unknown command /nonsense" in err
    assert out == "" and runs == []  # nothing after /exit was answered


def test_ctrl_c_stops_the_answer_keeps_its_text_and_the_chat_goes_on(
        chat_folder, runs, tmp_path, monkeypatch, capsys):
    runs, _ = runs
    steps, real_step = [], decode_step

    def interrupted_step(model, cache, token):  # Ctrl-C during the first answer's 3rd step
        steps.append(token)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step(model, cache, token)
    monkeypatch.setattr(decoding, "decode_step", interrupted_step)
    saved = tmp_path / "chat.json"
    out, err = chat(monkeypatch, capsys, chat_folder, ["Hello", "What is 2 + 2?",
                                                       f"/save {saved}"], "--baseline")
    assert "stopped: the answer so far stays in the conversation" in err
    assert len(runs[0]["answer"]) == 3  # the prefill's token and two steps'
    messages = json.loads(saved.read_text())
    assert len(messages) == 4 and out.startswith(messages[1]["content"] + "\n")
    [fresh] = fresh_answers(monkeypatch, capsys, tmp_path, chat_folder, [messages[:3]],
                            "--baseline")
    assert fresh["answer"] == messages[3]["content"]


@pytest.mark.parametrize("when_full", ["drop-oldest", "reset"])
def test_past_the_context_the_oldest_turns_go_or_the_chat_starts_over(
        when_full, tmp_path, default_model_dir, runs, monkeypatch, capsys):
    """A context of 96 tokens: the default system prompt and 3 exchanges of 8-token answers
    fill it; the fourth message drops the oldest exchanges (or all of them), in one line."""
    runs, _ = runs
    folder = model_folder(tmp_path / "small", default_model_dir, 96)
    saved = tmp_path / "chat.json"
    script = ["Hello", "What is 2 + 2?", "Tell me a story", "And another one", f"/save {saved}"]
    _, err = chat(monkeypatch, capsys, folder, script, "--when-full", when_full)
    [full] = [line for line in err.splitlines() if "would pass the model's context" in line]
    assert f"(--when-full {when_full})" in full
    assert len(runs) == 4 and all(len(r["prompt"]) + 8 <= 96 for r in runs)
    users = [m["content"] for m in json.loads(saved.read_text()) if m["role"] == "user"]
    if when_full == "reset":
        assert users == ["And another one"]
    else:  # the oldest exchange(s) gone, the later ones kept
        assert 1 < len(users) < 4 and users == script[4 - len(users):4]
    [fresh] = fresh_answers(monkeypatch, capsys, tmp_path, folder,
                            [json.loads(saved.read_text())[:-1]])
    assert fresh["answer"] == json.loads(saved.read_text())[-1]["content"]


def test_a_chat_whose_answers_leave_no_room_is_one_error_line(chat_folder, monkeypatch,
                                                              capsys):
    with pytest.raises(SystemExit, match="^error: --max-new-tokens 512 leaves no room"):
        chat(monkeypatch, capsys, chat_folder, ["Hello"], "--max-new-tokens", "512")


def test_a_message_longer_than_the_context_is_not_sent(tmp_path, default_model_dir, runs,
                                                      monkeypatch, capsys):
    runs, _ = runs
    folder = model_folder(tmp_path / "small", default_model_dir, 96)
    _, err = chat(monkeypatch, capsys, folder, ["word " * 100, "Hello"])
    assert "does not fit the model's context of 96 tokens; not sent" in err
    assert len(runs) == 1 and len(runs[0]["prompt"]) < 40  # "Hello" alone was answered


# --- prompts from standard input and from a file -----------------------------------------------

def test_standard_input_is_the_prompt_when_it_is_not_a_terminal(chat_folder, monkeypatch,
                                                                capsys):
    args = ["--model", chat_folder, *FAST, "--json"]
    piped = json.loads(run_main(monkeypatch, capsys, args, "What is 2 + 2?\n")[0])
    given = json.loads(run_main(monkeypatch, capsys, [*args, "--prompt", "What is 2 + 2?"])[0])
    assert piped["prompt_ids"] == given["prompt_ids"]
    assert piped["output_ids"] == given["output_ids"]


@pytest.mark.parametrize("stdin", ["", "\n  \n"])
def test_empty_standard_input_is_one_error_line(stdin, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit, match="^error: standard input is empty"):
        generate.main(["--max-new-tokens", "4"])


PROMPTS = ["What is 2 + 2?", "Hello", "Name a colour"]


@pytest.mark.parametrize("layout", ["lines", "jsonl"])
@pytest.mark.parametrize("mode", MODES)
def test_a_prompts_file_loads_once_and_answers_as_separate_runs(
        layout, mode, chat_folder, runs, tmp_path, monkeypatch, capsys):
    runs, loads = runs
    path = tmp_path / "prompts.txt"
    path.write_text("\n\n".join(json.dumps({"prompt": p}) if layout == "jsonl" else p
                                for p in PROMPTS) + "\n")
    out_file = tmp_path / "answers.jsonl"
    out, err = run_main(monkeypatch, capsys, ["--model", chat_folder, "--prompts", path,
                                              "--batch", "1", "--out", out_file, *FAST,
                                              *MODES[mode]])
    assert out == "" and len(loads) == 1
    answers = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [a["prompt"] for a in answers] == PROMPTS
    assert [line for line in err.splitlines() if line.startswith("prompts: ")][-1].startswith(
        "prompts: 3/3, ")
    assert "3 prompts] " in summaries(err)[-1] and "loaded once in" in summaries(err)[-1]
    for prompt, answer, run in zip(PROMPTS, answers, runs[:], strict=True):
        assert set(answer) == {"prompt", "answer", "tokens", "steps", "seconds"}
        assert answer["tokens"] == len(run["answer"])
        alone = json.loads(run_main(monkeypatch, capsys, ["--model", chat_folder, "--prompt",
                                                          prompt, "--json", *FAST,
                                                          *MODES[mode]])[0])
        assert alone["output_ids"] == run["answer"] and alone["text"] == answer["answer"]


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read it"),
    ("\n \n", "holds no prompt"),
    ('{"prompt": "Hi"}\nHello\n', 'line 2: not a JSON object with a "prompt"'),
    ('{"prompt": 3}\n', 'line 1: "prompt" must be a string or a list of messages'),
    ('{"prompt": [{"role": "robot", "content": "Hi"}]}\n', "line 1: \"prompt\" must be"),
])
def test_a_bad_prompts_file_is_one_error_line(content, needle, tmp_path, runs, monkeypatch,
                                              capsys):
    runs, loads = runs
    path = tmp_path / "prompts.txt"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(SystemExit) as exit:
        generate.main(["--prompts", str(path)])
    assert str(exit.value).startswith("error: ") and needle in str(exit.value)
    assert "\n" not in str(exit.value) and loads == []  # before the model loads


# --- the real default model --------------------------------------------------------------------

def test_a_chat_with_the_default_model_answers_as_fresh_runs(default_model_dir, runs, tmp_path,
                                                             monkeypatch, capsys):
    """Three greedy turns with the default model and heads: each answer == a fresh run's on the
    whole history, and the second and third turns prefill only their new tokens (the template's
    rendering extends the cache token for token)."""
    runs, _ = runs
    saved = tmp_path / "chat.json"
    flags = ["--no-compile", "--dtype", "float32", "--max-new-tokens", "24"]
    script = ["What is the capital of France?", "And of Germany?",
              "Which of the two is larger?", f"/save {saved}"]
    run_main(monkeypatch, capsys, ["--chat", *flags], "".join(s + "\n" for s in script))
    turns = runs[:]
    messages = json.loads(saved.read_text())
    path = tmp_path / "histories.jsonl"
    path.write_text("".join(json.dumps({"prompt": messages[:k]}) + "\n" for k in (1, 3, 5)))
    runs.clear()
    run_main(monkeypatch, capsys, ["--prompts", path, "--batch", "1", *flags])
    assert [r["answer"] for r in runs] == [t["answer"] for t in turns]
    for before, turn in zip(turns, turns[1:]):
        assert turn["kept"] == len(before["prompt"]) + len(before["answer"]) - 1
        assert turn["prefilled"] == len(turn["prompt"]) - turn["kept"]
