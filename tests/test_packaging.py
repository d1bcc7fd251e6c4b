"""What someone who installed the package, or unpacked its sdist, gets: not what a clone has.

An extra's install hint works outside a clone; the sdist holds what its tests and its README need
and no caches; ``import offload`` loads no checkpoint machinery and no optional library; the
metadata claims only the Pythons the code runs on and names only modules that exist.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, from the checkout (or the unpacked sdist)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


# -- an extra's hint works wherever the package was installed from --------------------------------

def test_no_message_says_to_install_from_a_clone():
    # `pip install -e ".[X]"` fails anywhere but in a clone, where the installed command says it too.
    sources = sorted((ROOT / "offload").rglob("*.py"))
    editable = [f"{path.relative_to(ROOT)}:{number}" for path in sources
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if re.search(r"pip install\s+(-e|--editable)\b", line)]
    assert editable == []
    # Each hint names an extra pyproject.toml has, written out or through install_hint.
    text = "\n".join(path.read_text() for path in sources)
    named = re.findall(r'pip install "offload\[([\w,]+)\]"', text) + re.findall(r"install_hint\(['\"](\w+)['\"]\)", text)
    assert named and {e for extras in named for e in extras.split(",")} <= EXTRAS


@pytest.mark.parametrize("module, library, extra", [
    ("offload.integrations.lightning", "lightning", "lightning"),
    ("offload.integrations.transformers", "transformers", "transformers"),
    ("offload.integrations.causal_lm", "transformers", "transformers"),
])
def test_an_integration_without_its_library_names_its_extra(module, library, extra):
    # None in sys.modules is what `import` meets for a package that is not installed.
    done = run_python(f"import sys; sys.modules[{library!r}] = None; import {module}")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and last.endswith(f'pip install "offload[{extra}]"'), done.stderr[-2000:]


def test_the_finetune_command_without_its_extra_names_it(tmp_path):
    done = run_python("import sys; sys.modules['tqdm'] = None\nfrom offload.cli.finetune import main\n"
                      "main(['--out', sys.argv[1], '--steps', '1', '--device', 'cpu'])", str(tmp_path / "out"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].endswith('Install the extra: pip install "offload[transformers]"')


def test_a_plot_without_matplotlib_names_its_extra(monkeypatch):
    from offload.profiling.plot import PlotUnavailable, check_plotting

    for name in [n for n in sys.modules if n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(PlotUnavailable, match=r'pip install "offload\[plot\]" \(or pip install matplotlib\)'):
        check_plotting()


# -- the sdist ------------------------------------------------------------------------------------

#: Folders of the checkout no sdist is built from: version control, environments, build outputs.
NOT_COPIED = {".git", ".venv", "venv", "build", "dist", "gpu_out"}
#: What a run leaves behind, planted in the copy: none of it may reach the sdist.
LEFT_BEHIND = [".venv/lib/python3.11/site-packages/torch/__init__.py", "tests/.pytest_cache/v/cache/nodeids",
               "tests/__pycache__/helpers.cpython-311.pyc", "docs/__pycache__/x.cpython-311.pyc",
               "benchmarks/__pycache__/bench_peers.cpython-311.pyc", "offload/__pycache__/model.cpython-311.pyc",
               "scripts/demo.pyc"]


def _not_copied(folder: str, names: list[str]) -> set[str]:
    at_root = NOT_COPIED if Path(folder) == ROOT else set()
    return {n for n in names if n in at_root or n in {"__pycache__", ".pytest_cache"} or n.endswith(".egg-info")
            or n.startswith(".gpu-check-tier-")}


@pytest.fixture(scope="module")
def sdist_names(tmp_path_factory) -> set[str]:
    """The paths in an sdist built from a copy of this tree, with a run's leftovers planted in it,
    by the build backend pyproject.toml names (what ``python -m build --sdist`` calls)."""
    tree = tmp_path_factory.mktemp("sdist") / "tree"
    shutil.copytree(ROOT, tree, ignore=_not_copied, symlinks=True)
    for name in LEFT_BEHIND:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(b"")
    backend = PYPROJECT["build-system"]["build-backend"]
    done = subprocess.run([sys.executable, "-c", f"import sys, {backend} as b; print(b.build_sdist(sys.argv[1]))",
                           str(tree.parent / "out")], cwd=tree, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    with tarfile.open(tree.parent / "out" / done.stdout.split()[-1]) as archive:
        return {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}


def _imported_by_tests() -> set[str]:
    """The files of this tree the test modules import: the tests package's modules, and the
    benchmarks and scripts modules some tests import from those folders."""
    files = {"tests/__init__.py", "tests/conftest.py"}
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.removeprefix("tests.")]
            elif isinstance(node, ast.Import):
                names = [alias.name.removeprefix("tests.") for alias in node.names]
            else:
                continue
            files |= {f"{folder}/{name}.py" for name in names for folder in ("tests", "benchmarks", "scripts")
                      if (ROOT / folder / f"{name}.py").is_file()}
    return files


def test_the_sdist_holds_every_module_its_tests_import(sdist_names):
    imported = _imported_by_tests()
    assert {"tests/helpers.py", "tests/conftest.py", "benchmarks/bench_peers.py"} <= imported  # the scan sees them
    assert sorted(imported - sdist_names) == []


def test_the_sdist_holds_what_its_readme_links_and_names(sdist_names):
    readme = (ROOT / "README.md").read_text()
    linked = {link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in link}
    named = set(re.findall(r"\b(?:scripts|docs|benchmarks)/[\w./-]+\.(?:py|md|sh)\b", readme))
    wanted = {p for p in linked | named if p and (ROOT / p).is_file()}
    assert {"docs/optimizer.md", "scripts/demo.py"} <= wanted
    assert sorted(wanted - sdist_names) == []
    assert {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")} <= sdist_names


def test_the_sdist_holds_no_cache_environment_or_compiled_file(sdist_names):
    left = [n for n in sdist_names
            if {".venv", "__pycache__", ".pytest_cache"} & set(n.split("/")) or n.endswith((".pyc", ".so"))]
    assert left == []


# -- import offload -------------------------------------------------------------------------------

def test_import_offload_loads_no_checkpoint_machinery_and_no_optional_library():
    # torch.distributed.checkpoint alone is about a second: offload.checkpoint loads at first use.
    done = run_python(
        "import json, sys\nimport offload\nbefore = sorted(sys.modules)\nnames = sorted(dir(offload))\n"
        "from offload import *\nprint(json.dumps([before, names, offload.__all__, save_checkpoint.__module__]))")
    assert done.returncode == 0, done.stderr[-3000:]
    before, names, public, module = json.loads(done.stdout)
    heavy = ["torch.distributed.checkpoint", "offload.checkpoint", "sympy", "transformers", "peft", "lightning",
             "accelerate", "trl", "datasets", "matplotlib", "torchao", "bitsandbytes"]
    assert [m for m in heavy if m in before] == []
    # Its names are there all the same, for `from offload import ...`, `import *` and dir().
    assert set(public) <= set(names) and module == "offload.checkpoint.saver"


def test_the_checkpoint_names_are_the_checkpoint_modules():
    import offload
    from offload.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

    assert (offload.CheckpointError, offload.latest_checkpoint, offload.load_checkpoint, offload.save_checkpoint) == (
        CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        getattr(offload, "no_such_name")


# -- metadata -------------------------------------------------------------------------------------

def test_requires_python_starts_where_exception_notes_do():
    # Error paths add notes (PEP 678: BaseException.add_note, new in 3.11) without a fallback.
    from packaging.specifiers import SpecifierSet

    supported = SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert not supported.contains("3.10.20") and supported.contains("3.11.0")
    versions = [c.rsplit(" :: ", 1)[1] for c in PYPROJECT["project"]["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert versions and all(supported.contains(f"{v}.0") for v in versions)


def test_pyproject_names_only_modules_that_exist():
    names = set(re.findall(r"\boffload(?:\.\w+)+", (ROOT / "pyproject.toml").read_text()))
    assert "offload.cli.finetune" in names

    def exists(name: str) -> bool:  # a module, or an attribute of one (offload.__version__)
        parent, _, attribute = name.rpartition(".")
        try:
            return importlib.util.find_spec(name) is not None or hasattr(importlib.import_module(parent), attribute)
        except ModuleNotFoundError:
            return False

    assert sorted(n for n in names if not exists(n)) == []
