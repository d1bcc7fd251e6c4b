"""The package's import graph: no cycles, and imports only run down the layers of
``docs/architecture.md`` ("Layers"), whose list :data:`LAYERS` mirrors. And the size of what is in
it: no class over :data:`MAX_CLASS_LINES` lines, no function body over :data:`MAX_BODY_LINES`, no
module over :data:`MAX_MODULE_LINES`.

Every ``import`` and ``from ... import`` in ``offload/`` counts, at module level, inside functions
and under ``if TYPE_CHECKING:`` alike: a function-level import that dodges a circle at import time
still ties the two modules together. The checker is tested on small fake graphs first, so a
broken checker cannot pass the real package silently.

And the repository's folders (docs/architecture.md, "The repository"): ``scripts/`` holds only the
tools a user runs (:data:`USER_TOOLS`, each answering ``--help``), ``benchmarks/`` the scripts that
measure or diagnose the library, which neither the package nor a tool imports.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "offload"

#: Layer number to the modules and packages in it, lowest first (a package stands for every module
#: under it). A module may import from its own layer and the layers below. Mirrored, in words, by
#: the "Layers" list of docs/architecture.md (``test_doc_mirrors_layers`` keeps the two together).
LAYERS: dict[int, list[str]] = {
    1: ["offload.arguments", "offload.streams", "offload.kernels"],
    2: ["offload.streamcheck"],
    3: ["offload.tiers"],
    4: ["offload.walk"],
    5: ["offload.autograd"],
    6: ["offload.planning"],
    7: ["offload.model", "offload.modeling", "offload.optimizer", "offload.optimizing", "offload.data_parallel",
        "offload.grad_scaler", "offload.clipping", "offload.per_tensor_warning"],
    8: ["offload.checkpoint", "offload.loading"],
    9: ["offload.integrations", "offload.profiling"],
    10: ["offload.cli", "offload"],
}


def module_files(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name to (file, whether it is a package's ``__init__``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules an import statement in module ``name`` names (absolute, maybe not in ``known``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in known]
    # `from . import a` imports the submodule a; the package itself only as its parent, which every
    # submodule import runs anyway, so it is no edge of its own.
    return submodules if len(submodules) == len(node.names) else [source, *submodules]


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module to the package modules it imports anywhere in its body."""
    modules = module_files(package)
    known = set(modules)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, is_package, node, known):
                while target not in known and "." in target:  # `import a.b.Name` names module a.b
                    target = target.rsplit(".", 1)[0]
                if target in known and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str, layers: dict[int, list[str]]) -> int | None:
    """The layer of the longest entry that is ``module`` or a package above it."""
    best: tuple[int, int] | None = None
    for layer, entries in layers.items():
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > best[0]):
                best = (len(entry), layer)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]], layers: dict[int, list[str]]) -> list[str]:
    """Each import from a module to one in a higher layer, and each module in no layer."""
    problems = [f"{module} is in no layer" for module in sorted(graph) if layer_of(module, layers) is None]
    for module in sorted(graph):
        low = layer_of(module, layers)
        for target in sorted(graph[module]):
            high = layer_of(target, layers)
            if low is not None and high is not None and high > low:
                problems.append(f"{module} (layer {low}) imports {target} (layer {high})")
    return problems


#: A class's lines, from its ``class`` line to its last, docstring and methods included. Set a
#: little above the package's largest class: a floor for taste, not a target. A class that grows
#: past it holds another job, which wants a name (a collaborator it owns, a helper for its step).
MAX_CLASS_LINES = 260
#: A function's body lines, from its first statement after the docstring to its last line; set a
#: little above the package's longest body, as the class limit is.
MAX_BODY_LINES = 52
#: Classes and functions allowed more lines for now, by ``module.qualified_name``: the most lines
#: each may have (a class's lines, a function's body lines), and why it is not split yet.
LONG_FOR_NOW: dict[str, tuple[int, str]] = {
}


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    assert node.end_lineno is not None
    return node.end_lineno - body[0].lineno + 1


def oversized(package: Path, allowed: dict[str, tuple[int, str]] | None = None) -> list[str]:
    """Each class longer than :data:`MAX_CLASS_LINES` and each function (methods and nested
    functions too) whose body is longer than :data:`MAX_BODY_LINES` (one in ``allowed``: than its
    ceiling there), as ``module.qualified_name`` with its count."""
    found = []
    ceilings = allowed or {}
    for name, (path, _) in module_files(package).items():

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    lines = child.end_lineno - child.lineno + 1
                    if lines > ceilings.get(f"{prefix}{child.name}", (MAX_CLASS_LINES, ""))[0]:
                        found.append(f"{prefix}{child.name}: class of {lines} lines")
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = _body_lines(child)
                    if lines > ceilings.get(f"{prefix}{child.name}", (MAX_BODY_LINES, ""))[0]:
                        found.append(f"{prefix}{child.name}: body of {lines} lines")
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text(), str(path)), f"{name}.")
    return found


#: A module's lines, all of them (docstring, comments and blank lines count: a reader reads them
#: too). A file holds one job; a module that grows past this holds several, and splits along them,
#: as ``torch.distributed.checkpoint`` splits a checkpoint into saver, loader, planner and storage.
MAX_MODULE_LINES = 600
#: Modules allowed more lines for now, by dotted name: the most lines each may have (its size when
#: listed: it may shrink, never grow), and why it is not split yet.
LONG_MODULES_FOR_NOW: dict[str, tuple[int, str]] = {}


def long_modules(package: Path, allowed: dict[str, tuple[int, str]] | None = None) -> dict[str, int]:
    """Each module longer than :data:`MAX_MODULE_LINES` lines (one in ``allowed``: than its
    ceiling there), with its number of lines."""
    found = {}
    for name, (path, _) in module_files(package).items():
        lines = len(path.read_text().splitlines())
        if lines > (allowed or {}).get(name, (MAX_MODULE_LINES, ""))[0]:
            found[name] = lines
    return found


# The checkers themselves, on inputs small enough to see the answer.

def test_size_checker_finds_long_modules_on_a_fake_package(tmp_path: Path) -> None:
    """Every line counts, the docstring's too: a module of one long docstring is a long module."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    docstring = lambda n: '"""' + "a line\n" * (n - 1) + '"""\n'  # noqa: E731
    (package / "fits.py").write_text(docstring(MAX_MODULE_LINES - 1) + "x = 1\n")
    (package / "sub" / "long.py").write_text(docstring(MAX_MODULE_LINES + 1))
    (package / "blank.py").write_text('"""One line."""\n' + "\n" * MAX_MODULE_LINES + "x = 1\n")
    assert long_modules(package) == {"pkg.blank": MAX_MODULE_LINES + 2, "pkg.sub.long": MAX_MODULE_LINES + 1}
    # A module listed for now passes up to its ceiling, and fails past it.
    ceilings = {"pkg.blank": (MAX_MODULE_LINES + 2, "why"), "pkg.sub.long": (MAX_MODULE_LINES, "why")}
    assert long_modules(package, ceilings) == {"pkg.sub.long": MAX_MODULE_LINES + 1}


def test_size_checker_finds_long_classes_and_bodies_on_a_fake_package(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    statements = lambda n, indent: "".join(f"{indent}x{k} = {k}\n" for k in range(n))  # noqa: E731
    docstring = '    """A docstring\n    of two lines, not counted."""\n'
    (package / "fits.py").write_text(
        f"def edge():\n{docstring}{statements(MAX_BODY_LINES, '    ')}\n"
        f"class Edge:\n{statements(MAX_CLASS_LINES - 1, '    ')}")
    (package / "long.py").write_text(
        f"def over():\n{docstring}{statements(MAX_BODY_LINES + 1, '    ')}\n"
        f"class Over:\n    def method(self):\n        def inner():\n{statements(MAX_BODY_LINES + 1, '            ')}"
        f"{statements(MAX_CLASS_LINES - MAX_BODY_LINES - 3, '    ')}")
    assert oversized(package) == [
        f"pkg.long.over: body of {MAX_BODY_LINES + 1} lines",
        f"pkg.long.Over: class of {MAX_CLASS_LINES + 1} lines",
        f"pkg.long.Over.method: body of {MAX_BODY_LINES + 2} lines",
        f"pkg.long.Over.method.inner: body of {MAX_BODY_LINES + 1} lines",
    ]
    # One listed for now passes up to its ceiling, and fails past it; the others keep the limits.
    ceilings = {"pkg.long.Over": (MAX_CLASS_LINES + 1, "why"), "pkg.long.over": (MAX_BODY_LINES, "why"),
                "pkg.long.Over.method": (MAX_BODY_LINES + 2, "why")}
    assert oversized(package, ceilings) == [f"pkg.long.over: body of {MAX_BODY_LINES + 1} lines",
                                            f"pkg.long.Over.method.inner: body of {MAX_BODY_LINES + 1} lines"]


def _measured(package: Path) -> list[tuple[str, Path, ast.AST, int]]:
    """Every class (with its lines) and every module-level function (with its body lines) of the
    package, as ``(module.qualified_name, file, node, count)``."""
    found = []
    for name, (path, _) in module_files(package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                found.append((f"{name}.{node.name}", path, node, node.end_lineno - node.lineno + 1))
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.FunctionDef):
                found.append((f"{name}.{node.name}", path, node, _body_lines(node)))
    return found


def _insert(path: Path, before_line: int, indent: int, count: int) -> None:
    """``count`` statements at ``indent`` columns, before line ``before_line`` (1-based) of ``path``."""
    lines = path.read_text().splitlines(keepends=True)
    lines[before_line - 1:before_line - 1] = [f"{' ' * indent}_padding{k} = {k}\n" for k in range(count)]
    path.write_text("".join(lines))


def test_the_package_fails_the_size_check_once_its_largest_class_or_body_grows(tmp_path: Path) -> None:
    """The limits bite on the package itself: its largest class (of those not listed for now) padded
    to one line over :data:`MAX_CLASS_LINES`, and its longest module-level function to one body line
    over :data:`MAX_BODY_LINES`, each in a copy of the package, are found, and nothing else is."""
    measured = [entry for entry in _measured(PACKAGE) if entry[0] not in LONG_FOR_NOW]
    name, path, node, lines = max((e for e in measured if isinstance(e[2], ast.ClassDef)), key=lambda e: e[3])
    copy = tmp_path / "classes" / "offload"
    shutil.copytree(PACKAGE, copy)
    assert isinstance(node, ast.ClassDef) and node.end_lineno is not None
    _insert(copy / path.relative_to(PACKAGE), node.end_lineno + 1, node.col_offset + 4, MAX_CLASS_LINES + 1 - lines)
    assert oversized(copy, LONG_FOR_NOW) == [f"{name}: class of {MAX_CLASS_LINES + 1} lines"]

    name, path, node, lines = max((e for e in measured if isinstance(e[2], ast.FunctionDef)), key=lambda e: e[3])
    copy = tmp_path / "functions" / "offload"
    shutil.copytree(PACKAGE, copy)
    assert isinstance(node, ast.FunctionDef)
    first = node.body[1] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body[0]
    _insert(copy / path.relative_to(PACKAGE), first.lineno, first.col_offset, MAX_BODY_LINES + 1 - lines)
    assert oversized(copy, LONG_FOR_NOW) == [f"{name}: body of {MAX_BODY_LINES + 1} lines"]


# The import checker itself, on graphs small enough to see the answer.

def test_checker_finds_cycles_on_a_fake_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_checker_finds_upward_imports_on_a_fake_graph() -> None:
    layers = {1: ["p.low"], 2: ["p.high", "p"]}
    graph = {"p.low.x": {"p.high"}, "p.high": {"p.low.x"}, "p": {"p.high"}, "q": set()}
    assert upward_imports(graph, layers) == ["q is in no layer", "p.low.x (layer 1) imports p.high (layer 2)"]


def test_import_graph_reads_every_kind_of_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("from . import b\nA = 1\n")
    (package / "b.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from .sub.c import C\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("def f():\n    from ..a import A\n    import pkg.b\n    return A\n")
    assert import_graph(package) == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"},
                                     "pkg.sub": set(), "pkg.sub.c": {"pkg.a", "pkg.b"}}
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


# The package.

def test_package_has_no_import_cycles() -> None:
    assert cycles(import_graph(PACKAGE)) == []


def test_imports_run_down_the_layers() -> None:
    assert upward_imports(import_graph(PACKAGE), LAYERS) == []


def test_no_class_or_function_body_is_too_long() -> None:
    """Classes with one job, functions that read at a glance: split what grows past the limits
    along its jobs (collaborators it owns, helpers named for their step)."""
    assert oversized(PACKAGE, LONG_FOR_NOW) == []


def test_each_class_or_function_listed_for_now_exists_and_needs_it() -> None:
    """An entry of :data:`LONG_FOR_NOW` names a class or function of the package that is over the
    limit today: one split since (or renamed) leaves the list."""
    assert sorted(entry.split(":")[0] for entry in oversized(PACKAGE)) == sorted(LONG_FOR_NOW)


def test_no_module_is_too_long() -> None:
    """One job a module (each file opens with a docstring that says which): split what grows past
    the limit along its jobs, into modules named for them; a module listed for now may not grow."""
    assert long_modules(PACKAGE, LONG_MODULES_FOR_NOW) == {}


def test_every_module_says_what_it_holds() -> None:
    """Each file opens with a docstring saying its one job (and, where it helps, what it does not hold)."""
    assert [name for name, (path, _) in module_files(PACKAGE).items()
            if not ast.get_docstring(ast.parse(path.read_text(), str(path)))] == []


def test_doc_mirrors_layers() -> None:
    """Each numbered item of the doc's layer list names exactly the entries of that layer."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"^(\d+)\. ", section, flags=re.M)[1:]
    documented = {int(number): body for number, body in zip(items[::2], items[1::2])}
    assert sorted(documented) == sorted(LAYERS)
    for layer, entries in LAYERS.items():
        named = set(re.findall(r"`(offload[\w.]*)`", documented[layer].split(": ", 1)[0]))
        assert named == set(entries), f"layer {layer}"


#: The modules of former circles, each of which must import first, before any other of the package.
IMPORTED_FIRST = ["offload.integrations.transformers_loading", "offload.integrations.causal_lm",
                  "offload.profiling.results", "offload.streams.host_storage"]

#: Run in one fresh interpreter, which imports torch (and transformers, where installed) but
#: nothing of the package: for each module named in argv, a forked child of it imports that module
#: first, as a fresh interpreter would (a circle is within the package; the libraries below it are
#: imported once, here). Prints each one's traceback, or "" where it imported.
_IMPORT_EACH_FIRST = """
import importlib.util, json, os, sys, traceback
import torch
if importlib.util.find_spec("transformers") is not None:
    import transformers
assert not [m for m in sys.modules if m == "offload" or m.startswith("offload.")]
errors = {}
for name in sys.argv[1:]:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        try:
            __import__(name)
            message = ""
        except BaseException:
            message = traceback.format_exc() or "failed"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(child, 0)
    errors[name] = message if os.waitstatus_to_exitcode(status) == 0 else f"exit status {status}: {message}"
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def imported_first() -> dict[str, str]:
    """Each module of :data:`IMPORTED_FIRST` imported first, one after the other, in one fresh
    interpreter: module name to its traceback ("" where it imported)."""
    modules = [m for m in IMPORTED_FIRST if "integrations" not in m or _has_transformers()]
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_FIRST, *modules], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


@pytest.mark.parametrize("first", IMPORTED_FIRST)
def test_any_module_imports_first(first: str, imported_first: dict[str, str]) -> None:
    """Each module of a former circle imports on its own, before any other module of the package."""
    if "integrations" in first:
        pytest.importorskip("transformers")
    assert imported_first[first] == "", imported_first[first]


# -- the repository: tools, library and measurements apart ---------------------------------------------------

#: The tools a user runs from a clone, the only files in ``scripts/`` (docs/architecture.md, "The
#: repository"). A script that measures or diagnoses the library goes in ``benchmarks/`` instead.
USER_TOOLS = ("demo.py", "finetune_causal_lm.py", "load_checkpoint.py", "profile_memory.py", "train_distributed.py")


def _imported_top_names(path: Path) -> set[str]:
    """The first component of every absolute import in one file (``import a.b``, ``from a import b``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def misplaced_scripts(root: Path, tools: tuple[str, ...] = USER_TOOLS) -> list[str]:
    """What breaks the split between ``scripts/`` (the tools), ``offload/`` (the library) and
    ``benchmarks/`` (the measurements): a file in ``scripts/`` that is not a listed tool, a listed
    tool missing or under ``benchmarks/``, and a measurement that the library or a tool imports
    (then it is no measurement: it belongs in the package)."""
    problems = [f"scripts/{path.name}: not a user tool; a measurement goes in benchmarks/, a tool in USER_TOOLS"
                for path in sorted((root / "scripts").iterdir()) if path.name not in (*tools, "__pycache__")]
    problems += [f"scripts/{name}: listed in USER_TOOLS but missing" for name in tools
                 if not (root / "scripts" / name).is_file()]
    measurements = {path.stem for path in (root / "benchmarks").glob("*.py")}
    problems += [f"benchmarks/{name}: a user tool, which belongs in scripts/" for name in tools
                 if name[:-3] in measurements]
    users = [*sorted((root / "offload").rglob("*.py")), *sorted((root / "scripts").glob("*.py"))]
    for path in users:
        for name in sorted(_imported_top_names(path) & measurements):
            problems.append(f"{path.relative_to(root).as_posix()} imports benchmarks/{name}.py")
    return problems


def test_split_checker_finds_misplaced_scripts_on_a_fake_tree(tmp_path: Path) -> None:
    for folder in ("scripts", "benchmarks", "offload"):
        (tmp_path / folder).mkdir()
    (tmp_path / "scripts" / "demo.py").write_text("import offload\n")
    (tmp_path / "scripts" / "__pycache__").mkdir()  # what importing a tool leaves
    (tmp_path / "benchmarks" / "bench_x.py").write_text("import offload\n")
    (tmp_path / "offload" / "model.py").write_text("from . import bench_x\n")  # relative: the package's own
    assert misplaced_scripts(tmp_path, ("demo.py",)) == []

    (tmp_path / "scripts" / "bench_y.py").write_text("")
    (tmp_path / "offload" / "planner.py").write_text("def f():\n    from bench_x import build\n")
    (tmp_path / "scripts" / "demo.py").write_text("import bench_x.sub\n")
    (tmp_path / "benchmarks" / "tool.py").write_text("")
    assert misplaced_scripts(tmp_path, ("demo.py", "tool.py")) == [
        "scripts/bench_y.py: not a user tool; a measurement goes in benchmarks/, a tool in USER_TOOLS",
        "scripts/tool.py: listed in USER_TOOLS but missing",
        "benchmarks/tool.py: a user tool, which belongs in scripts/",
        "offload/planner.py imports benchmarks/bench_x.py",
        "scripts/demo.py imports benchmarks/bench_x.py",
    ]


def test_scripts_hold_the_user_tools_and_benchmarks_the_measurements() -> None:
    """``scripts/`` is "the thing I run", ``benchmarks/`` is "how it was measured", ``offload/``
    depends on neither."""
    assert misplaced_scripts(ROOT) == []


@pytest.mark.parametrize("tool", USER_TOOLS)
def test_each_user_tool_answers_help(tool: str) -> None:
    from .test_docs import help_text  # cached: the docs check asks the same tools

    assert help_text(f"scripts/{tool}").startswith("usage:")


def test_doc_tree_names_every_top_level_folder() -> None:
    """docs/architecture.md's tree ("The repository") lists each folder the repository tracks, and no other."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text.split("## The repository", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    shown = {line.split()[0].split("/")[0] for line in tree.splitlines() if line[:1] not in (" ", "")}
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = {line.split("/")[0] for line in tracked.splitlines() if "/" in line}
    assert shown == folders
