"""Every input a user hands generate.py, damaged in each way a file or a stream gets damaged
(missing, empty, cut short, binary, JSON of another kind, a value of another kind, a value
too large), ends in one `error:` line or a correct answer: never a traceback, never a crash.
Not a replay of the reported cases: each file and each of its values goes through the same
damages. generate.py's main runs in the test's process on a tiny random model."""
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import REPO, model_folder, slow_except
from generate import main as generate_main
from minimedusa.files import tokenizer as tokenizer_module
from minimedusa.errors import UserError
from minimedusa.files.heads_files import save_draft_vocab, save_heads
from minimedusa.heads import MedusaConfig, MedusaHeads
from minimedusa.files.tokenizer import render_chat

FILE_DAMAGES = {"missing": None, "empty": b"", "binary": bytes(range(256)) * 4,
                "a list": b"[]", "null": b"null", "a string": b'"x"', "a number": b"5"}
VALUE_DAMAGES = ["x", [1], {"a": 1}, -1, 0, 10 ** 12, None, True, 1.5, math.inf]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    """A tiny random Llama with the real tokenizer and chat template, and untrained heads."""
    folder = model_folder(tmp_path_factory.mktemp("damage") / "tiny", default_model_dir, 64)
    save_heads(MedusaHeads(MedusaConfig(2, 1, 32, 49152)), folder / "heads")
    return folder


def one_run(argv: list[str], stdin: str = "") -> str:
    """generate.py's main on argv: "answered", or its one error line (a traceback fails)."""
    out, err = io.StringIO(), io.StringIO()
    sys_stdin, sys.stdin = sys.stdin, io.StringIO(stdin)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(sys, "stdout", out)
            m.setattr(sys, "stderr", err)
            generate_main(argv)
        return "answered"
    except SystemExit as e:
        message = str(e.code)
        assert message.startswith("error: ") and "\n" not in message, message
        return message
    finally:
        sys.stdin = sys_stdin


def damaged_copy(folder, tmp_path, name: str, data: bytes | None):
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    if data is None:
        (copy / name).unlink()
    else:
        (copy / name).write_bytes(data)
    return copy


def answer(folder, *flags: str) -> str:
    return one_run(["--model", str(folder), "--prompt", "Hi", "--max-new-tokens", "3",
                    "--no-compile", *flags])


@pytest.mark.parametrize("damage", [*FILE_DAMAGES, "cut short"])
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "model.safetensors"])
def test_a_damaged_model_file_is_one_line(name, damage, tiny_folder, tmp_path):
    whole = (tiny_folder / name).read_bytes()
    data = whole[:len(whole) // 2] if damage == "cut short" else FILE_DAMAGES[damage]
    said = answer(damaged_copy(tiny_folder, tmp_path, name, data), "--baseline")
    assert said != "answered" or (name == "tokenizer_config.json" and damage == "missing")


def rewritten_weights(folder, tmp_path, change):
    """A copy of the model folder whose every tensor went through change(name, tensor)."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    state = load_file(copy / "model.safetensors")
    save_file({k: change(k, t) for k, t in state.items()}, copy / "model.safetensors")
    return copy


@pytest.mark.parametrize("change, needle", [
    (lambda k, t: t > 0, "stored as bool"),
    (lambda k, t: (t * 100).to(torch.int32), "stored as int32"),
    (lambda k, t: t.masked_fill(t.abs() > 0.1, math.nan) if "layers.1.mlp" in k else t, "NaN"),
    (lambda k, t: t.masked_fill(t.abs() > 0.3, math.inf) if "norm" in k else t, "NaN or inf"),
    (lambda k, t: t.half().masked_fill(t.abs() > 0.3, -math.inf).float()
     if "embed" in k else t, "inf"),
], ids=["bools", "integers", "NaN in a block", "inf in a norm", "-inf in the embedding"])
def test_weights_that_load_but_cannot_decode_are_one_line_naming_the_tensor(change, needle,
                                                                            tiny_folder,
                                                                            tmp_path):
    said = answer(rewritten_weights(tiny_folder, tmp_path, change), "--baseline")
    assert said.startswith("error: tensor ") and needle in said


@pytest.mark.kernels
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_heads_holding_nan_or_inf_are_one_line(value, shared_heads, tmp_path):
    copy = tmp_path / "heads"
    shutil.copytree(shared_heads, copy)
    state = load_file(copy / "medusa_lm_head.safetensors")
    state["1.0.linear.weight"][3, 5] = value
    save_file(state, copy / "medusa_lm_head.safetensors")
    said = answer(shared_heads.parent, "--heads", str(copy))
    assert said.startswith("error: tensor 1.0.linear.weight") and "not finite" in said


def test_a_tokenizer_whose_ids_pass_the_embedding_is_one_line(tiny_folder, tmp_path):
    """The tokenizer's 49,152 ids against a model of 49,000 rows: another model's files."""
    copy = rewritten_weights(tiny_folder, tmp_path, lambda k, t: t[:49000] if "embed" in k
                             or "lm_head" in k else t)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "vocab_size": 49000}))
    said = answer(copy, "--baseline")
    assert said.startswith("error: the tokenizer's ids run to 49151") and "49000 rows" in said


@pytest.mark.parametrize("sizes, needle", [({"hidden_size": 30}, "not a multiple"),
                                           ({"head_dim": 7}, "must be even"),
                                           ({"hidden_size": 36}, "must be even")])
def test_a_head_of_odd_dims_is_one_line(sizes, needle, tiny_folder, tmp_path):
    """head_dim given odd, or left out and hidden_size / num_attention_heads (4) odd or not
    whole."""
    config = json.loads((tiny_folder / "config.json").read_text())
    config.pop("head_dim")
    copy = damaged_copy(tiny_folder, tmp_path, "config.json",
                        json.dumps({**config, **sizes}).encode())
    said = answer(copy, "--baseline")
    assert said.startswith("error: ") and needle in said


@pytest.mark.kernels
# by default a count, a float, a flag and a table; every key under -m slow
@pytest.mark.parametrize("key", slow_except([
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "head_dim",
    "eos_token_id", "bos_token_id", "tie_word_embeddings", "model_type", "architectures",
    "rope_scaling", "sliding_window"],
    "vocab_size", "rope_theta", "tie_word_embeddings", "rope_scaling"))
def test_a_config_value_of_another_kind_is_one_line_or_an_answer(key, tiny_folder, tmp_path):
    config = json.loads((tiny_folder / "config.json").read_text())
    for value in VALUE_DAMAGES:
        text = json.dumps({**config, key: value}).replace("Infinity", "1e999")
        answer(damaged_copy(tiny_folder, tmp_path, "config.json", text.encode()), "--baseline")
        shutil.rmtree(tmp_path / "copy")


@pytest.mark.parametrize("index", [
    b"not json", b"[]", b"{}", b'{"weight_map": []}', b'{"weight_map": {}}',
    b'{"weight_map": {"embed": 5}}', b'{"weight_map": {"x": "../model.safetensors"}}',
    b'{"weight_map": {"x": "/etc/passwd"}}', b'{"weight_map": {"x": "sub/model.safetensors"}}'])
def test_a_damaged_or_escaping_safetensors_index_is_one_line(index, tiny_folder, tmp_path):
    folder = damaged_copy(tiny_folder, tmp_path, "model.safetensors.index.json", index)
    said = answer(folder, "--baseline")
    assert said.startswith("error: ") and "model.safetensors.index.json" in said


@pytest.mark.parametrize("damage", [*FILE_DAMAGES, "cut short", "a pickle with code",
                                    "a pickle of another kind"])
@pytest.mark.parametrize("name", ["config.json", "medusa_lm_head.safetensors"])
def test_damaged_heads_are_one_line(name, damage, tiny_folder, tmp_path):
    heads = tiny_folder / "heads"
    whole = (heads / name).read_bytes()
    data = whole[:len(whole) // 2] if damage == "cut short" else FILE_DAMAGES.get(damage)
    copy = damaged_copy(tiny_folder, tmp_path, f"heads/{name}", data)
    if damage.startswith("a pickle"):  # only the reference's medusa_lm_head.pt, not safetensors
        (copy / "heads" / "medusa_lm_head.safetensors").unlink(missing_ok=True)
        payload = ({"0.0.linear.weight": torch.zeros(2), "x": os.system}
                   if damage == "a pickle with code" else [torch.zeros(2)])
        torch.save(payload, copy / "heads" / "medusa_lm_head.pt")
    said = answer(copy, "--heads", str(copy / "heads"))
    assert said.startswith("error: ")
    assert "weights_only=False" not in said  # torch's advice: the one thing not to do


def test_a_pickle_with_code_is_never_run_and_said_so(tiny_folder, tmp_path):
    copy = damaged_copy(tiny_folder, tmp_path, "heads/medusa_lm_head.safetensors", None)
    torch.save({"0.0.linear.weight": torch.zeros(2), "x": os.system},
               copy / "heads" / "medusa_lm_head.pt")
    said = answer(copy, "--heads", str(copy / "heads"))
    assert said == (f"error: {copy / 'heads' / 'medusa_lm_head.pt'} holds more than tensors "
                    "(pickled code or objects), which is never run here: keep heads as "
                    "medusa_lm_head.safetensors")


@pytest.mark.kernels
@pytest.mark.parametrize("key", slow_except([
    "medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size", "shared_lm_head",
    "head_kind", "draft_vocab_size"], "medusa_num_heads", "head_kind"))
def test_a_heads_config_value_of_another_kind_is_one_line_or_an_answer(key, tiny_folder,
                                                                       tmp_path):
    config = json.loads((tiny_folder / "heads" / "config.json").read_text())
    for value in VALUE_DAMAGES:
        text = json.dumps({**config, key: value}).replace("Infinity", "1e999")
        copy = damaged_copy(tiny_folder, tmp_path, "heads/config.json", text.encode())
        answer(copy, "--heads", str(copy / "heads"))
        shutil.rmtree(copy)


CALIBRATION_DAMAGES = {**{k: v for k, v in FILE_DAMAGES.items() if v is not None},
                       "no accuracy": b'{"x": [[0.5]]}', "an empty one": b'{"accuracy": []}',
                       "ragged": b'{"accuracy": [[0.5, 0.2], [0.4]]}',
                       "strings": b'{"accuracy": [["0.5", "a"], ["b", "c"]]}',
                       "NaN": b'{"accuracy": [[NaN, 0.1], [0.2, 0.1]]}',
                       "above 1": b'{"accuracy": [[1.5, 0.1], [0.2, 0.1]]}',
                       "negative": b'{"accuracy": [[0.5, -0.1], [0.2, 0.1]]}',
                       "flat": b'{"accuracy": [0.5, 0.2]}', "deep": b"[" * 5000 + b"]" * 5000}


@pytest.fixture(scope="module")
def shared_heads(tiny_folder):
    """Shared-head Medusa heads with a calibration and a draft vocabulary, as train.py and the
    tree search leave them: their own files read when generate.py decodes with them."""
    folder = tiny_folder / "shared-heads"
    save_heads(MedusaHeads(MedusaConfig(2, 1, 32, 49152, shared_lm_head=True)), folder,
               {"draft_vocab_size": 64})
    (folder / "calibration.json").write_text(json.dumps({"accuracy": [[0.5, 0.2], [0.3, 0.1]]}))
    save_draft_vocab(folder, torch.arange(100, 300), torch.arange(200, 0, -1))
    assert answer(tiny_folder, "--heads", str(folder)) == "answered"
    return folder


@pytest.mark.parametrize("damage", CALIBRATION_DAMAGES)
def test_a_damaged_calibration_is_one_line_naming_it(damage, shared_heads, tmp_path):
    copy = tmp_path / "heads"
    shutil.copytree(shared_heads, copy)
    (copy / "calibration.json").write_bytes(CALIBRATION_DAMAGES[damage])
    said = answer(shared_heads.parent, "--heads", str(copy))
    assert said.startswith("error: ") and "calibration.json" in said


@pytest.mark.parametrize("ids, counts", [
    (torch.arange(8).reshape(2, 4), torch.ones(2, 4)),  # 2-D
    (torch.zeros(0, dtype=torch.long), torch.zeros(0)),  # empty
    (torch.arange(8).float(), torch.ones(8)),  # floats
    (torch.tensor([5, 1_000_000_000]), torch.ones(2)),  # past the vocabulary
    (torch.tensor([5, -1]), torch.ones(2)),  # negative
    (torch.tensor([5, 5, 6]), torch.ones(3)),  # repeated
    (torch.tensor([5, 6, 7]), torch.ones(2)),  # counts of another length
    (torch.tensor([True, False]), torch.ones(2)),  # bools
], ids=["2-D", "empty", "floats", "past the vocabulary", "negative", "repeated",
        "counts of another length", "bools"])
def test_a_draft_vocabulary_of_another_kind_is_one_line_naming_it(ids, counts, shared_heads,
                                                                  tmp_path):
    copy = tmp_path / "heads"
    shutil.copytree(shared_heads, copy)
    save_draft_vocab(copy, ids, counts)
    said = answer(shared_heads.parent, "--heads", str(copy))
    assert said.startswith("error: ") and "draft_vocab.safetensors" in said


@pytest.mark.parametrize("template", [
    "{{ range(10**12)|list }}", "{{ 'x' * 10**10 }}", "{{ 'x'|center(10**10) }}",
    "{{ ('x' * 100000)|replace('x', 'x' * 100000) }}", "{{ '{:>1000000000}'.format(1) }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'y' * 10 }}{% endfor %}"
    "{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"],
    ids=["a huge range", "a huge string", "a huge centre", "a huge replace", "a huge format",
         "endless recursion", "endless output", "endless loops"])
def test_a_runaway_chat_template_is_one_line_within_its_budget(template, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "TEMPLATE_SECONDS", 1.0)
    start = time.perf_counter()
    with pytest.raises(UserError, match="^the model's chat template exceeded its budget"):
        render_chat(template, [{"role": "user", "content": "Hi"}], {})
    assert time.perf_counter() - start < 5
    assert render_chat("{{ messages[0].content }}", [{"role": "user", "content": "Hi"}],
                       {}) == "Hi"  # the budget is lifted after


def test_a_runaway_template_in_a_model_folder_is_one_line(tiny_folder, tmp_path):
    config = json.loads((tiny_folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'x' * 10**10 }}"
    folder = damaged_copy(tiny_folder, tmp_path, "tokenizer_config.json",
                          json.dumps(config).encode())
    assert answer(folder, "--baseline").startswith(
        "error: the model's chat template exceeded its budget")


@pytest.mark.parametrize("text", ["Hi \udcff there", "\udc80"])
def test_text_that_is_not_utf8_is_one_line_wherever_it_comes_from(text, tiny_folder, tmp_path):
    flags = ["--model", str(tiny_folder), "--max-new-tokens", "3", "--no-compile", "--baseline"]
    assert "not valid UTF-8" in one_run([*flags, "--prompt", text])
    assert "not valid UTF-8" in one_run([*flags, "--prompt", "Hi", "--system", text])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": text}) + "\n")  # JSON's "\udcff": valid JSON
    said = one_run([*flags, "--prompts", str(prompts)])
    assert said.startswith(f"error: --prompts {prompts} line 1: ") and "UTF-8" in said


@pytest.mark.parametrize("data", [b"\xff\xfe\x00binary", b"Hi \x80 there", bytes(range(256))])
def test_binary_standard_input_is_one_line(data, tiny_folder):
    done = subprocess.run([sys.executable, str(REPO / "generate.py"), "--model",
                           str(tiny_folder), "--no-compile", "--baseline"],
                          input=data, capture_output=True, timeout=300, cwd=REPO)
    assert done.returncode == 1 and done.stdout == b""
    [line] = done.stderr.decode().splitlines()
    assert line.startswith("error: standard input is not UTF-8 text (byte 0x")


@pytest.mark.parametrize("threads", ["0", "-1", "100000", "5000", "x", "1e3"])
def test_threads_out_of_bounds_are_one_line_before_any_loading(threads, monkeypatch, capsys):
    monkeypatch.setattr("generate.ensure_default_model", lambda: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as stop:
        generate_main(["--prompt", "Hi", "--threads", threads])
    assert stop.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: argument --threads: ")


@pytest.mark.parametrize("flag", ["--temperature", "--top-p", "--eps", "--delta"])
@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e999", "x"])
def test_a_number_flag_out_of_range_is_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        generate_main(["--prompt", "Hi", flag, value])
    assert stop.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: argument {flag}: ")


def test_a_chat_line_that_is_not_utf8_is_said_and_the_chat_goes_on(tiny_folder):
    done = subprocess.run([sys.executable, str(REPO / "generate.py"), "--model",
                           str(tiny_folder), "--no-compile", "--baseline", "--chat",
                           "--max-new-tokens", "2"],
                          input=b"\xff\xfe binary\nHi\n/exit\n", capture_output=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "that line is not UTF-8 text (byte 0xff): not sent" in done.stderr.decode()
    assert "Traceback" not in done.stderr.decode()


def another_models_gguf(path) -> None:
    """A whole GGUF file, of no Llama: gguf's own writer, one tensor."""
    import gguf
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("content", [b"", b"hello, not a GGUF\n", b"GGUF" + bytes(range(200)),
                                     "another model's"],
                         ids=["empty", "text", "cut short after its magic", "another model's"])
def test_a_gguf_that_is_no_llama_is_one_line_and_leaves_the_folder(content, tmp_path,
                                                                   monkeypatch, capsys):
    """python -m minimedusa.files.default_model --gguf F: one error line (a file that is no
    GGUF at all, before any notice), and the folder it would have replaced is as it was (nor a
    .partial beside it)."""
    from minimedusa.files import default_model
    gguf_file, out = tmp_path / "model.gguf", tmp_path / "out"
    if isinstance(content, bytes):
        gguf_file.write_bytes(content)
    else:
        another_models_gguf(gguf_file)
    out.mkdir()
    (out / "config.json").write_text("an earlier conversion's")
    monkeypatch.setattr(sys, "argv", ["default_model", "--gguf", str(gguf_file), "--out",
                                      str(out)])
    with pytest.raises(SystemExit) as end:
        default_model.main()
    message = str(end.value.code)
    assert message.startswith(f"error: cannot convert {gguf_file}") and "\n" not in message
    if not gguf_file.read_bytes().startswith(b"GGUF"):
        assert capsys.readouterr().err == ""
    assert (out / "config.json").read_text() == "an earlier conversion's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "out"]
