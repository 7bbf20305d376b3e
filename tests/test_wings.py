"""The house's plan, read off its source with ast: the paper's core (minimedusa/*.py) imports no
wing (speed/, training/, files/, bench/, assembly/, cli/, experiments/) and reads no attribute a wing gives
its objects; no module imports itself back through others, nor more than a reader can hold in
mind; the README reads the core in an order of its imports; medusa_decode takes the paper's
loop's parts, no switch; a weight format is an object, its name compared nowhere but in its
registry; every file and function stays small enough to read in one sitting, with room under
each limit (ROOM)."""
import ast
import inspect
from pathlib import Path

import pytest
import torch.nn as nn

from minimedusa.decoding import medusa_decode
from minimedusa.speed.weight_formats import FORMATS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minimedusa"
WINGS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
CORE = sorted(PACKAGE.glob("*.py"))
ENTRY_POINTS = [ROOT / "generate.py", ROOT / "train.py"]
# The limits, each kept with room: a file that reaches 95% of one is split before it squeezes.
ROOM = 0.95
PYTHON_LINES, FUNCTION_LINES, CORE_FILES = 350, 50, 15
C_LINES = 700  # C and C++: one CPU path of a kernel a file, with its comments (group_kernel_*.h)
MOST_IMPORTS = 10  # project modules one module imports, but where the wiring is the job:
WIRING = ("minimedusa.bench.", "minimedusa.training.", "minimedusa.assembly.recipe")  # and entry points
# Where speed enters: the one module outside speed/ that calls what plugs it into a model, its
# heads, their draft and the acceptance rule (the recipe, after loading).
SPEED_DOOR = PACKAGE / "assembly" / "recipe.py"
# What other wings may import of speed (its face: the machine's facts, the formats' names, the
# door's words); the rest only the recipe and the load that reads weights into speed's formats.
# files/ (file formats) and experiments/ (the core's extensions) are read whole, as the core.
SPEED_FACE = {f"minimedusa.speed.{name}" for name in ("defaults", "weight_formats", "machine",
                                                      "cache_folder", "plug_in")}
SPEED_INSIDE = {SPEED_DOOR, PACKAGE / "assembly" / "load.py"}
PLUG_INS = {"plug_in", "plug_in_heads", "fast_draft", "greedy_for", "sampling_for",
            "checked_step", "formatted_model", "apply_format", "fuse_blocks", "compile_blocks",
            "graph_step"}


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
    assert len(CORE) <= CORE_FILES * ROOM, "the package's top folder holds the core alone"
    for path in CORE:
        wings = {n for n in imports(path) if n.split(".")[1] in WINGS}
        assert not wings, f"{path.name} imports a wing: {sorted(wings)}"


def test_speed_imports_only_the_core():
    """speed/ plugs into the core's objects: it reads no file format, flag or experiment."""
    core = {module_name(p) for p in CORE}
    for path in (PACKAGE / "speed").glob("*.py"):
        modules = {n if n in package_modules() else n.rsplit(".", 1)[0] for n in imports(path)}
        outside = {n for n in modules - {"minimedusa"}
                   if n not in core and not n.startswith("minimedusa.speed")}
        assert not outside, f"speed/{path.name} imports {sorted(outside)}"


def test_speed_is_plugged_in_at_one_place():
    """Outside speed/, only the recipe calls what swaps speed into a model, heads, draft or
    rule: generate.py, bench, the latency timing and training all get it from there."""
    for path in [p for p in PACKAGE.rglob("*.py") if p.parent.name != "speed"] + ENTRY_POINTS:
        if path == SPEED_DOOR:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                assert name not in PLUG_INS, f"{path.name}:{node.lineno} calls {name}"
    called = {getattr(n.func, "id", None) for n in ast.walk(ast.parse(SPEED_DOOR.read_text()))
              if isinstance(n, ast.Call)}
    assert {"plug_in", "plug_in_heads", "fast_draft", "greedy_for"} <= called


def calls(path: Path) -> set[str]:
    """The names a file calls (f(...) and x.f(...))."""
    return {getattr(n.func, "id", getattr(n.func, "attr", None))
            for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}


def names_a_format(node: ast.AST) -> bool:
    """A string constant that is a weight format's name, or a tuple, set or list holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in FORMATS
    return isinstance(node, (ast.Tuple, ast.Set, ast.List)) and any(map(names_a_format, node.elts))


def format_name_comparisons(source: str) -> list[str]:
    """Every comparison in `source` of something with a format's name (== "int4", in ("int4",
    "w4a8")), as line: code. A name listed (argparse's choices, a dict's keys) compares nothing."""
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare)
            and any(map(names_a_format, [node.left, *node.comparators]))]


def test_a_weight_format_is_an_object_its_name_compared_only_by_its_registry():
    """A format is chosen once (weight_formats.format_named, assembly/load.py) and carried: what
    differs between formats is an attribute or a method of the object (fmt.rounds, fmt.fused(),
    fmt.error), never a test of its name outside speed/weight_formats.py. And the check sees
    what it is for: a comparison planted in a source is found, a list of choices is not."""
    assert len(format_name_comparisons('if fmt == "int4" or name in ("int8", "w4a8"): pass')) == 2
    assert not format_name_comparisons('p.add_argument("--q", choices=("int4",))\nd = {"int4": 1}')
    registry = PACKAGE / "speed" / "weight_formats.py"
    for path in [p for p in PACKAGE.rglob("*.py") if p != registry] + ENTRY_POINTS:
        found = format_name_comparisons(path.read_text())
        assert not found, f"{path.relative_to(ROOT)} compares a format's name: {found}"


def test_experiments_plug_in_by_one_call_where_the_recipe_and_training_start():
    """experiments/ registers nothing when imported (no statement of its modules writes into a
    table); it plugs in by experiments.register_decoding, which the recipe calls, and
    register_training, which train.py, the tree search and held_out call. Outside it only those,
    and bench's batches (Medusa in a batch), import it: the heads files and the training reach
    it through their tables."""
    for path in (PACKAGE / "experiments").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            assert not any(isinstance(t, (ast.Subscript, ast.Attribute)) for t in targets), \
                f"{path.name}:{node.lineno} writes into a table when imported"
    importers = {path.relative_to(ROOT).as_posix()
                 for path in [*PACKAGE.rglob("*.py"), *ENTRY_POINTS]
                 if path.parent.name != "experiments"
                 and any(n.startswith("minimedusa.experiments") for n in imports(path))}
    training = ["train.py", "minimedusa/training/tree_search.py",
                "minimedusa/training/held_out.py"]
    assert importers == {"minimedusa/assembly/recipe.py", "minimedusa/bench/batches.py",
                         *training}, importers
    assert "register_decoding" in calls(PACKAGE / "assembly" / "recipe.py")
    assert all("register_training" in calls(ROOT / path) for path in training)


def test_no_wing_but_the_wiring_reaches_into_speeds_internals():
    """The entry points, bench/ (which times speed's parts one by one) and training/ wire what
    they need; every other module outside speed/ imports its face, or is one of its doors."""
    modules = package_modules()
    for path in [p for p in PACKAGE.rglob("*.py")] + ENTRY_POINTS:
        name = module_name(path) if path.is_relative_to(PACKAGE) else path.stem
        if path in SPEED_INSIDE or path in ENTRY_POINTS or name.startswith(
                ("minimedusa.speed.", *WIRING[:2])):
            continue
        speed = {n if n in modules else n.rsplit(".", 1)[0] for n in imports(path)
                 if n.startswith("minimedusa.speed")}
        assert speed <= SPEED_FACE | {"minimedusa.speed"}, f"{name} imports {sorted(speed)}"


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


def test_no_module_imports_more_than_a_reader_holds():
    modules = package_modules()
    for name, path in modules.items():
        if name.startswith(WIRING):
            continue
        # a module imported, or the module a name is imported from (not a package's name)
        imported = {n if n in modules else n.rsplit(".", 1)[0] for n in imports(path)}
        imported = {n for n in imported if n in modules} - {name}
        assert len(imported) <= MOST_IMPORTS, f"{name} imports {len(imported)} project modules"


def attributes_stored(path: Path, on_self: bool) -> set[str]:
    """The attribute names a file assigns: on `self` (its own objects) or on any other object."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    mine = isinstance(sub.value, ast.Name) and sub.value.id == "self"
                    if mine == on_self:
                        found.add(sub.attr)
        if (not on_self and isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
            found.add(node.args[1].value)
    return found


def core_defines(path: Path) -> set[str]:
    """What the core's own classes define: attributes, fields, methods, buffers."""
    found = attributes_stored(path, on_self=True) | attributes_stored(path, on_self=False)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            found |= {b.target.id for b in node.body
                      if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)}
            found |= {b.name for b in node.body if isinstance(b, ast.FunctionDef)}
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "register_buffer":
            found.add(node.args[0].value)
    return found


def test_the_core_reads_no_attribute_a_wing_gives_its_objects():
    """Speed swaps the core's modules (an attribute the core or torch defines, given another
    value); it never adds one that the core then branches on."""
    wings = [p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE] + ENTRY_POINTS
    given = set().union(*(attributes_stored(p, on_self=False) for p in wings))
    defined = set().union(*(core_defines(p) for p in CORE))
    added = {a for a in given - defined if not hasattr(nn.Linear(1, 1), a)}
    for path in CORE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                assert node.attr not in added, f"{path.name}:{node.lineno} reads .{node.attr}"


def test_the_readmes_reading_order_follows_the_imports():
    """The README's table of the core, read top to bottom, meets each file after every core
    file it imports (errors.py, imported everywhere, is named below the table), and names
    every core file."""
    table = [line.split("`")[1] for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("| `") and line.split("`")[1].endswith(".py")]
    order = [f"minimedusa.{name[:-3]}" for name in table]
    core = {module_name(p) for p in CORE} - {"minimedusa.__init__", "minimedusa.errors"}
    assert set(order) == core
    modules = package_modules()
    for i, name in enumerate(order):
        imported = {n if n in modules else n.rsplit(".", 1)[0] for n in imports(modules[name])}
        later = (imported & core) - set(order[:i]) - {name}
        assert not later, f"{name} imports {sorted(later)}, read after it"


def test_medusa_decode_takes_the_loops_parts_and_no_switch():
    parameters = inspect.signature(medusa_decode).parameters.values()
    assert len(parameters) <= 8
    for p in parameters:
        assert p.annotation is not bool and not isinstance(p.default, bool), p.name


def limit(path: Path) -> int:
    return C_LINES if path.suffix in (".c", ".h", ".cpp") else PYTHON_LINES


SOURCES = sorted([*PACKAGE.rglob("*.py"), *ENTRY_POINTS,
                  *(p for s in ("*.c", "*.h", "*.cpp") for p in PACKAGE.rglob(s))])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_and_functions_stay_small(path):
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= limit(path) * ROOM, f"{path.name}: {lines} lines, limit {limit(path)}"
    if path.suffix != ".py":
        return
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= FUNCTION_LINES * ROOM, f"{path.name}: {node.name} has {lines} lines"
