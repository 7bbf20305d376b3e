"""Every command line's --help prints its usage and exits 0: argparse expands each help text
with %, so one bare % (a percentage) in any flag's help breaks --help alone."""
import importlib
import sys

import pytest

COMMANDS = ["generate", "train", "minimedusa.bench.bench", "minimedusa.bench.format_quality",
            "minimedusa.training.tree_search", "minimedusa.training.self_distill",
            "minimedusa.training.seed_prompts", "minimedusa.files.default_model",
            "minimedusa.files.export_v1", "minimedusa.bench.model_size"]


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_line_prints_its_help(module, monkeypatch, capsys):
    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module, "--help"])  # main() parses sys.argv's flags
    with pytest.raises(SystemExit) as end:
        main()
    assert end.value.code == 0 and "usage:" in capsys.readouterr().out
