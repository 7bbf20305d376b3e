"""Every command line's --help prints its usage and exits 0: argparse expands each help text
with %, so one bare % (a percentage) in any flag's help breaks --help alone."""
import importlib
import sys

import pytest

from helpers import REPO

# the two scripts and every module run with `python -m` (those with a __main__ block), found, so
# that a new command cannot be left out
MODULES = [path for path in (REPO / "minimedusa").rglob("*.py")
           if '__name__ == "__main__"' in path.read_text()]
COMMANDS = ["generate", "train", *sorted(
    path.relative_to(REPO).with_suffix("").as_posix().replace("/", ".") for path in MODULES)]


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_line_prints_its_help(module, monkeypatch, capsys):
    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module, "--help"])  # main() parses sys.argv's flags
    with pytest.raises(SystemExit) as end:
        main()
    assert end.value.code == 0 and "usage:" in capsys.readouterr().out
