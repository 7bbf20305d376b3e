"""The house's plan, read off its source with ast: the paper's core (minimedusa/*.py) imports no
wing (speed/, training/, files/, bench/, flags/), no module imports itself back through others,
and every file and function stays small enough to read in one sitting."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minimedusa"
WINGS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def module_name(path: Path) -> str:
    """minimedusa/speed/quantized.py -> "minimedusa.speed.quantized"."""
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def imports(path: Path) -> set[str]:
    """The minimedusa modules a file imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] == "minimedusa")
    return found


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_the_core_imports_no_wing():
    core = [p for p in PACKAGE.glob("*.py")]
    assert len(core) <= 15, "the package's top folder holds the core alone"
    for path in core:
        wings = {n for n in imports(path) if n.split(".")[1] in WINGS}
        assert not wings, f"{path.name} imports a wing: {sorted(wings)}"


def test_no_module_imports_itself_back():
    modules = package_modules()
    graph = {name: sorted(n for n in imports(path) if n in modules and n != name)
             for name, path in modules.items()}
    done, path = set(), []  # modules whose imports are all checked; the chain being followed

    def visit(name):  # depth first: a module met again on the chain closes a cycle
        if name in path:
            raise AssertionError(" -> ".join(path[path.index(name):] + [name]))
        if name not in done:
            path.append(name)
            for imported in graph[name]:
                visit(imported)
            done.add(path.pop())
    for name in graph:
        visit(name)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: module_name(p))
def test_files_and_functions_stay_small(path):
    source = path.read_text()
    assert len(source.splitlines()) <= 350, f"{path.name}: over 350 lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= 50, f"{path.name}: {node.name} has {lines} lines"
