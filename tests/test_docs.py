"""The README and docs/ stay true: what they name exists, what they show runs or at least compiles.

Checked for README.md and every docs/*.md:

- every path they name under ``scripts/``, ``benchmarks/``, ``docs/``, ``offload/``, ``tests/`` or
  ``.ci/`` exists, and every ``offload.<module>`` they name is a module of the package;
- every ``--flag`` a command gives a script in ``scripts/`` or ``benchmarks/`` (or a
  ``python -m offload.<tool>``) appears in that script's ``--help``;
- every fenced Python snippet compiles;
- every signature the prose states (``load_causal_lm(path, device, *, dtype=None, ...)``) is the
  library's, as ``inspect.signature`` has it;
- every relative link resolves to a file, and its ``#anchor`` to a heading of that file.

Templates (``benchmarks/results/benchmark_<device>_<date>.json``) are not paths and are skipped.
And what a tool's refusal advises, documentation read when it is needed, is so: the command it
gives runs what was asked, the formats it lists are those taken.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Documents linked from the README that land with other work on the library. A link to one of
# them may dangle until it exists; remove each entry once its file is in docs/.
PENDING_DOCS = frozenset({
})

PATH_ROOTS = ("scripts", "benchmarks", "docs", "offload", "tests", ".ci")
PATH = re.compile(r"(?<![\w./$-])((?:%s)/[\w./-]*)" % "|".join(re.escape(r) for r in PATH_ROOTS))
DATA_FILE_SUFFIXES = (".json",)
MODULE = re.compile(r"(?<![\w.])offload(?:\.[a-z_]\w*)+")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# python scripts/x.py (or benchmarks/x.py), torchrun [its options] scripts/x.py, python -m offload.x; then
# the arguments.
# The installed commands ([project.scripts]) count as ``python -m`` their module.
SCRIPT_CALL = re.compile(r"(?:(?:python3?|torchrun(?:\s+--\S+)*)\s+((?:scripts|benchmarks)/[\w/]+\.py)"
                         r"|python3?\s+-m\s+(offload(?:\.\w+)+)"
                         r"|(?<![\w/-])(offload-finetune|(?:python3?\s+-m\s+)?offload\s+(?:plan|calibrate)(?![\w-])))"
                         r"((?:\s+[^\s|;&#]+)*)")
CONSOLE_SCRIPTS = {"offload-finetune": "offload.cli.finetune", "offload plan": "offload.cli.plan",
                   "offload calibrate": "offload.cli.calibrate"}


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Problem:
    document: str
    what: str

    def __str__(self) -> str:
        return f"{self.document}: {self.what}"


def strip_fences(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``_`` dropped, spaces as hyphens
    (an underscore stays: ``estimate_memory`` in a heading anchors as ``estimate_memory``)."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", strip_fences(path.read_text()), re.M)}


def broken_links(path: Path, text: str, pending: frozenset[str] = PENDING_DOCS) -> list[Problem]:
    problems = []
    for target in LINK.findall(strip_fences(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            if resolved.is_relative_to(ROOT) and resolved.relative_to(ROOT).as_posix() in pending:
                continue
            problems.append(Problem(doc_id(path), f"link {target!r}: no such file"))
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(Problem(doc_id(path), f"link {target!r}: no heading with that anchor"))
    return problems


def missing_paths(path: Path, text: str) -> list[Problem]:
    problems = []
    for m in PATH.finditer(text):
        name = m.group(1).rstrip(".")
        if text[m.end():m.end() + 1] in "<{*":  # a template, not a path
            continue
        if name in PENDING_DOCS:
            continue
        if not (ROOT / name).exists():
            problems.append(Problem(doc_id(path), f"names {name!r}, which does not exist"))
    for m in MODULE.finditer(text):
        if m.group(0).endswith(DATA_FILE_SUFFIXES):  # a file the library writes (offload.json), not a module
            continue
        if not names_something(m.group(0)):
            problems.append(Problem(doc_id(path), f"names {m.group(0)!r}, which is no module or attribute"))
    return problems


def is_module(parts: list[str]) -> bool:
    where = ROOT.joinpath(*parts)
    return where.with_suffix(".py").exists() or (where / "__init__.py").exists()


def names_something(dotted: str) -> bool:
    """``offload.a.b`` is a module of the package, or ``b`` is an attribute of module ``offload.a``."""
    parts = dotted.split(".")
    if is_module(parts):
        return True
    if not is_module(parts[:-1]):
        return False
    return hasattr(importlib.import_module(".".join(parts[:-1])), parts[-1])


def commands(text: str) -> list[str]:
    """Shell lines of the document: fenced bash blocks (continuations joined) and inline code."""
    lines = []
    for lang, body in FENCE.findall(text):
        if lang in ("bash", "sh", "shell", ""):
            lines += body.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`([^`\n]*python[^`\n]*)`", strip_fences(text))
    return lines


def script_calls(text: str) -> list[tuple[str, str]]:
    """Each script or module the document runs, with the arguments it gives it."""
    calls = []
    for line in commands(text):
        for m in SCRIPT_CALL.finditer(line):
            target = m.group(1) or m.group(2) or CONSOLE_SCRIPTS[" ".join(m.group(3).split()[-2:])
                                                                 if " " in m.group(3) else m.group(3)]
            calls.append((target, m.group(4)))
    return calls


#: Prints ``{target: [exit status, --help's output]}`` for each target given (a script's path or
#: a module), each run as ``python TARGET --help`` would run it.
EVERY_HELP = """
import contextlib, io, json, os, runpy, sys
texts = {}
for target in sys.argv[1:]:
    sys.argv, out, code = [target, "--help"], io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            if target.endswith(".py"):
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as python TARGET does
                try:
                    runpy.run_path(target, run_name="__main__")
                finally:
                    sys.path.pop(0)
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exit_info:
        code = exit_info.code
    except BaseException:
        code = 1
    texts[target] = [code, out.getvalue()]
print(json.dumps(texts))
"""


@functools.cache
def every_help_text() -> dict[str, str]:
    """The ``--help`` of every script and module the documents run, from one interpreter: a fresh
    one each costs seconds of imports. A target that fails there is left out (run alone by
    :func:`help_text`, which reports its failure)."""
    targets = sorted({target for document in documents() for target, _ in script_calls(document.read_text())
                      if not target.endswith(".py") or (ROOT / target).exists()})
    done = subprocess.run([sys.executable, "-c", EVERY_HELP, *targets], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        return {}
    return {target: text for target, (code, text) in json.loads(done.stdout.splitlines()[-1]).items() if code == 0}


@functools.cache
def help_text(target: str) -> str:
    if target in every_help_text():
        return every_help_text()[target]
    args = [target] if target.endswith(".py") else ["-m", target]
    done = subprocess.run([sys.executable, *args, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{target} --help failed:\n{done.stderr[-2000:]}"
    return done.stdout


def unknown_flags(path: Path, text: str) -> list[Problem]:
    problems = []
    for target, arguments in script_calls(text):
        if target.endswith(".py") and not (ROOT / target).exists():
            continue  # reported by missing_paths
        help_ = help_text(target)
        for flag in re.findall(r"(?<![\w-])--[\w-]+", arguments):
            if not re.search(re.escape(flag) + r"(?![\w-])", help_):
                problems.append(Problem(doc_id(path), f"{target} has no {flag} in its --help"))
    return problems


def snippets_that_do_not_compile(path: Path, text: str) -> list[Problem]:
    problems = []
    for i, (lang, body) in enumerate(FENCE.findall(text)):
        if lang != "python":
            continue
        try:
            compile(body, f"{doc_id(path)} snippet {i}", "exec")
        except SyntaxError as e:
            problems.append(Problem(doc_id(path), f"python snippet {i} does not compile: {e}"))
    return problems


#: Prose signatures with no ``*`` or ``**`` to tell them from a call, as (document, the name as
#: written there): checked as the others are.
PROSE_SIGNATURES = frozenset({
    ("docs/disk-tier.md", "DiskTier"),
    ("docs/huggingface.md", "offload.integrations.data.token_blocks"),
    ("docs/huggingface.md", "shuffled"),
})
INLINE_CALL = re.compile(r"`((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(([^`]*)\)`")
# A bare ``*``, ``*args`` or ``**options`` among the arguments: a signature, never a call.
STAR = re.compile(r"(?:^|,)\s*\*")


def stated_signature(arguments: str) -> inspect.Signature | None:
    """The signature ``name(arguments)`` states, or None where the arguments are a call's
    (``hf, loss_chunk_tokens=1024`` reads as one; ``..., masters=DiskTier(path)`` does not)."""
    try:
        args = ast.parse(f"def f({arguments}): ...").body[0].args
        positional = [*args.posonlyargs, *args.args]
        defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults))
        defaults += [ast.literal_eval(d) for d in args.defaults]
        keyword = [inspect.Parameter.empty if d is None else ast.literal_eval(d) for d in args.kw_defaults]
    except (SyntaxError, ValueError, TypeError):
        return None
    kinds = [inspect.Parameter.POSITIONAL_ONLY] * len(args.posonlyargs)
    kinds += [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(args.args)
    parameters = [inspect.Parameter(a.arg, kind, default=d) for a, kind, d in zip(positional, kinds, defaults)]
    if args.vararg:
        parameters.append(inspect.Parameter(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    parameters += [inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY, default=d)
                   for a, d in zip(args.kwonlyargs, keyword)]
    if args.kwarg:
        parameters.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(parameters)


def offload_callable(name: str, text: str) -> Any:
    """What a name in the prose stands for: ``offload.a.b`` by its path; a bare name among
    ``offload.__all__`` or the ``__all__`` of a module the document names. None: not offload's."""
    import offload

    if name.startswith("offload."):
        module, _, attribute = name.rpartition(".")
        return getattr(importlib.import_module(module), attribute, None) if is_module(module.split(".")) else None
    if "." in name:
        return None
    if name in offload.__all__:
        return getattr(offload, name)
    named = [m.group(0).split(".") for m in MODULE.finditer(text)]  # a module, or an attribute of one
    for module in sorted({".".join(parts) for whole in named for parts in (whole, whole[:-1]) if is_module(parts)}):
        if name in getattr(importlib.import_module(module), "__all__", ()):
            return getattr(importlib.import_module(module), name)
    return None


def prose_signatures(path: Path, text: str,
                     listed: frozenset = PROSE_SIGNATURES) -> list[tuple[int, str, inspect.Signature, Any]]:
    """``(line, name, the signature stated, the function or class)`` for each prose signature of
    one of offload's (a span with a ``*`` or ``**``, or a name :data:`PROSE_SIGNATURES` lists for
    the document, where its arguments read as parameters: ``DiskTier("/nvme")`` is a call)."""
    found = []
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # fences out, lines kept
    for m in INLINE_CALL.finditer(prose):
        name, arguments = m.groups()
        if (doc_id(path), name) not in listed and not STAR.search(arguments):
            continue
        stated, target = stated_signature(arguments), offload_callable(name, text)
        if stated is not None and target is not None:
            found.append((prose.count("\n", 0, m.start()) + 1, name, stated, target))
    return found


def prose_signature_mismatches(path: Path, text: str, listed: frozenset = PROSE_SIGNATURES) -> list[Problem]:
    """Each prose signature that is not ``inspect.signature``'s: the parameters' names, order,
    defaults, and which are keyword-only."""
    problems = []
    for line, name, stated, target in prose_signatures(path, text, listed):
        actual = inspect.signature(target)
        actual = actual.replace(parameters=[p.replace(annotation=p.empty) for p in actual.parameters.values()],
                                return_annotation=actual.empty)
        if str(stated) != str(actual):
            problems.append(Problem(doc_id(path), f"line {line} states {name}{stated}; the code: {name}{actual}"))
    return problems


@pytest.mark.parametrize("document", documents(), ids=doc_id)
def test_links_resolve(document):
    problems = broken_links(document, document.read_text())
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("document", documents(), ids=doc_id)
def test_named_paths_and_modules_exist(document):
    problems = missing_paths(document, document.read_text())
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("document", documents(), ids=doc_id)
def test_script_flags_exist(document):
    problems = unknown_flags(document, document.read_text())
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("document", documents(), ids=doc_id)
def test_python_snippets_compile(document):
    problems = snippets_that_do_not_compile(document, document.read_text())
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("document", documents(), ids=doc_id)
def test_prose_signatures_are_the_librarys(document):
    problems = prose_signature_mismatches(document, document.read_text())
    assert not problems, "\n".join(map(str, problems))


def test_listed_prose_signatures_are_in_the_docs():
    # An entry whose signature left its page checks nothing; remove it so the list stays honest.
    checked = {(document, name) for document in {d for d, _ in PROSE_SIGNATURES}
               for _, name, _, _ in prose_signatures(ROOT / document, (ROOT / document).read_text())}
    assert sorted(PROSE_SIGNATURES - checked) == []


def test_pending_docs_are_still_pending():
    # An entry whose file has landed only hides nothing; remove it so the list stays honest.
    assert [name for name in sorted(PENDING_DOCS) if (ROOT / name).exists()] == []


def test_the_checks_catch_what_they_are_for():
    # Each check reports a planted mistake, so the tests above can fail.
    readme = ROOT / "README.md"
    assert broken_links(readme, "see [API](docs/no-such.md)") != []
    assert broken_links(readme, "see [API](docs/api.md#no-such-heading)") != []
    assert broken_links(readme, "see [API](docs/api.md#limitations)") == []
    assert missing_paths(readme, "run `scripts/no_such.py` and `offload.no_such_module`") != []
    assert missing_paths(readme, "writes `benchmarks/results/benchmark_<device>.json`") == []
    assert unknown_flags(readme, "```bash\npython scripts/demo.py --no-such-flag\n```\n") != []
    assert unknown_flags(readme, "```bash\npython scripts/demo.py --steps 5 \\\n    --device cpu\n```\n") == []
    assert unknown_flags(readme, "```bash\ntorchrun --nproc_per_node=2 scripts/demo.py --no-such-flag\n```\n") != []
    assert unknown_flags(readme, "`python benchmarks/bench_cast.py --no-such-flag`") != []
    assert unknown_flags(readme, "`python benchmarks/bench_cast.py --mib 1`") == []
    assert unknown_flags(readme, "```bash\noffload-finetune --no-such-flag\n```\n") != []
    assert unknown_flags(readme, "```bash\noffload-finetune --out x --data y.jsonl --grad-accum 2\n```\n") == []
    assert unknown_flags(readme, "```bash\npython -m offload plan --preset tiny --no-such-flag\n```\n") != []
    assert unknown_flags(readme, "```bash\noffload calibrate --dir /nvme\n```\n") == []
    assert snippets_that_do_not_compile(readme, "```python\nmodel(\n```\n") != []
    # Prose signatures: a parameter left out, a keyword-only one stated positional; a call is no signature.
    loading = "from offload.integrations.transformers import load_causal_lm\n`load_causal_lm({})`"
    assert prose_signature_mismatches(readme, loading.format("path, device, *, dtype=None, **options")) != []
    token_blocks = "`offload.integrations.data.token_blocks(source, tokenizer, block_size, {}text_field=None)`"
    assert prose_signature_mismatches(readme, token_blocks.format(""),
                                      frozenset({("README.md", "offload.integrations.data.token_blocks")})) != []
    assert prose_signature_mismatches(readme, token_blocks.format("*, ")) == []
    assert prose_signature_mismatches(readme, "`latest_checkpoint(directory, *, keep=3)`") != []
    assert prose_signature_mismatches(readme, "`OffloadModel(..., masters=DiskTier(path))`") == []


def test_the_suite_lists_why_tests_skipped(tmp_path):
    # The Quick start's test run ends with one line per skip reason (tests/conftest.py).
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_needs_an_extra(i):\n"
        "    pytest.skip('the extra is not installed')\n"
    )
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           str(tmp_path / "test_skips.py")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "skipped, by reason" in done.stdout, done.stdout
    assert "    3  the extra is not installed" in done.stdout, done.stdout


def test_a_base_install_imports_and_runs_the_demo_without_a_numpy_warning():
    # PyTorch warns at import when NumPy is missing, and its CPU wheel does not install it: NumPy is
    # one of offload's own dependencies, so no script has to filter that warning.
    from packaging.requirements import Requirement
    from setuptools.config.pyprojecttoml import read_configuration

    dependencies = read_configuration(ROOT / "pyproject.toml", expand=True)["project"]["dependencies"]
    assert "numpy" in {Requirement(d).name for d in dependencies}
    from .test_scripts import demo_run

    done = demo_run()  # -W default: every warning shown
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""


def test_the_version_has_one_source():
    import offload
    from setuptools.config.pyprojecttoml import read_configuration

    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", offload.__version__)
    assert read_configuration(ROOT / "pyproject.toml", expand=True)["project"]["version"] == offload.__version__


# A refusal's advice is documentation read at the moment it is needed: what it says to run runs,
# and what it says is taken is.

def test_the_torchrun_hint_is_the_command_given():
    # Copying the hint trains what was asked for: the user's arguments, not the usage example's.
    done = subprocess.run([sys.executable, "scripts/train_distributed.py", "--preset", "tiny", "--steps", "3",
                           "--out", "a run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.rstrip().endswith("torchrun --nproc_per_node=2 scripts/train_distributed.py --preset tiny "
                                         "--steps 3 --out 'a run'"), done.stderr


def test_the_data_format_error_names_every_format_the_reader_takes(tmp_path):
    from offload.integrations.data import STREAMED, TEXT_SUFFIXES, DataFormatError, token_blocks

    (tmp_path / "corpus.xml").write_text("<a/>")
    with pytest.raises(DataFormatError) as refused:
        next(token_blocks(tmp_path / "corpus.xml", None, 4))
    unnamed = [suffix for suffix in (*TEXT_SUFFIXES, ".jsonl", ".json", *STREAMED)
               if not re.search(re.escape(suffix) + r"\b", str(refused.value))]   # .jsonl names no .json
    assert unnamed == [], str(refused.value)


@pytest.mark.parametrize("gpu, advice", [([], "or pass --gpu NAME"),
                                         (["--gpu", "a100"], "or leave out --rates: --gpu alone needs no calibration")],
                         ids=["without --gpu", "with --gpu"])
def test_plan_advises_what_was_not_given_already(gpu, advice, tmp_path, capsys):
    from offload.cli.plan import main

    with pytest.raises(SystemExit):
        main(["--preset", "tiny", *gpu, "--rates", str(tmp_path / "none.json")])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.endswith(f"no such file; run `python -m offload calibrate --out {tmp_path / 'none.json'}` {advice}")
