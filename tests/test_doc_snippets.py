"""Every fenced Python snippet in README.md and docs/*.md runs as written, on the CPU, at tiny sizes.

The rules, for whoever writes a snippet:

- A snippet runs as it stands, with ``"cuda"`` read as ``"cpu"`` and ``.cuda()`` dropped
  (:data:`ON_THE_CPU`), in an empty working directory of its own and the namespace its page's
  earlier snippets left: it imports what it uses, unless an earlier snippet of the page did, as a
  reader copying the page in order would have it.
- What the reader supplies (``layers``, a ``loader``, ``"path/to/llama"``, ``train.txt``) comes
  from a setup named on the line before the fence, ``<!-- snippet-setup: NAME -->`` (invisible to
  readers). The setup is a function of ``tests/doc_snippets.py``; :data:`SETUPS` lists the variants
  the snippet runs under and the sizes the test makes small (``max_steps=2000`` -> ``max_steps=2``).
  A setup gives only names ``tests/doc_snippets.py`` lists as the reader's (``READER_NAMES``),
  never an import.
- A snippet that is not code to run (a signature, an excerpt that needs other processes) is marked
  ``<!-- fragment: why -->`` on the line before the fence; it still has to compile.

An unmarked snippet that fails, a fragment without a reason, an unknown setup, and a setup no
snippet uses are all failures. All the snippets run in one process, one after the other (the
imports are paid once), under :data:`TIMEOUT_S`.

Shell blocks are not run here: each command they give a script of the project has its ``--help``
run and its flags checked by ``tests/test_docs.py``; the rest install packages, run the test suite,
benchmarks or multi-process jobs.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.doc_snippets import reader_names
from tests.test_docs import ROOT, doc_id, documents


TIMEOUT_S = 900
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*(snippet-setup|fragment):\s*(.*?)\s*-->\s*\Z")

#: Applied to every snippet that runs: the CPU stands for the accelerator.
ON_THE_CPU = (('"cuda"', '"cpu"'), (".cuda()", ""))


@dataclass(frozen=True)
class Variant:
    """One way to run the snippets of a setup: the function of ``tests/doc_snippets.py`` that
    prepares their names and files (``""``: none), and the text replacements that make them small."""

    function: str
    replace: tuple[tuple[str, str], ...] = ()


TRAINER_SIZES = (("max_steps=2000", "max_steps=2"), ("gradient_accumulation_steps=8", "gradient_accumulation_steps=2"))

#: Setup name (as the Markdown names it) -> the variants its snippets run under.
SETUPS: dict[str, tuple[Variant, ...]] = {
    "layers": (Variant("layers"),),
    "disk": (Variant("disk", (('"/nvme/offload"', '"nvme/offload"'),)),),
    "model": (Variant("model"),),
    "optimizer": (Variant("optimizer"),),
    "classifier": (Variant("classifier", (("1024", "64"), ("4096", "64"))),),
    "torchrun": (Variant("torchrun", (('"nccl"', '"gloo"'), ('f"cuda:{local_rank}"', '"cpu"'))),),
    "weights": (Variant("weights", (("8192", "64"),)),),
    "hf": (Variant("hf"),),
    # The tokenizer offload-finetune writes has no special tokens; a pretrained one usually has
    # an end-of-sequence token and no padding token.
    "trainer": (Variant("trainer_byte_tokenizer", TRAINER_SIZES), Variant("trainer_eos_tokenizer", TRAINER_SIZES)),
    # On a machine without a GPU, bfloat16 (SFTConfig's default) needs use_cpu.
    "sft": (Variant("sft", (("max_steps=1000", "max_steps=2"), ("max_length=2048", "max_length=64"),
                            ("gradient_accumulation_steps=4", "gradient_accumulation_steps=1"),
                            ("report_to=[])", "report_to=[], use_cpu=True)"))),),
    "tuned": (Variant("tuned", (('"/tmp/tuned"', '"tuned"'),)),),
    "sequential-lm": (Variant("sequential_lm"),),
    "profile": (Variant("", (("n_layers=12, d_model=1024",
                              "n_layers=2, d_model=32, vocab=256, seq_len=32, batch_size=2"),
                             ("slices=[4, 8], microbatches=[1, 4]", "slices=[2], microbatches=[1]"))),),
}


@dataclass(frozen=True)
class Snippet:
    document: str
    index: int      # among the document's Python snippets
    line: int
    code: str
    setup: str | None = None
    fragment: str | None = None   # why it is not run

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line} (python snippet {self.index})"


def snippets(document: str, text: str) -> list[Snippet]:
    found = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        kind, value = marker.groups() if marker else (None, None)
        found.append(Snippet(document, len(found), line, m.group(2),
                             setup=value if kind == "snippet-setup" else None,
                             fragment=value if kind == "fragment" else None))
    return found


def marker_problems(found: list[Snippet]) -> list[str]:
    problems = []
    for snippet in found:
        if snippet.fragment is not None:
            if not snippet.fragment:
                problems.append(f"{snippet.name}: a fragment says why it is not run: <!-- fragment: why -->")
            try:
                compile(snippet.code, snippet.name, "exec")
            except SyntaxError as e:
                problems.append(f"{snippet.name}: a fragment that does not compile: {e}")
        elif snippet.setup is not None and snippet.setup not in SETUPS:
            problems.append(f"{snippet.name}: no setup {snippet.setup!r} (tests/test_doc_snippets.py SETUPS)")
    return problems


def jobs(found: list[Snippet], workdir: Path) -> list[dict]:
    """What ``tests/doc_snippets.py`` runs: each snippet to run, once per variant of its setup."""
    listed = []
    for snippet in found:
        if snippet.fragment is not None:
            continue
        for number, variant in enumerate(SETUPS.get(snippet.setup, (Variant(""),))):
            code = snippet.code
            for old, new in (*ON_THE_CPU, *variant.replace):
                code = code.replace(old, new)
            directory = workdir / f"{snippet.document.replace('/', '-')}-{snippet.index}-{number}"
            directory.mkdir()
            listed.append({"id": f"{snippet.name} [setup {variant.function or 'none'}]", "name": snippet.name,
                           "page": snippet.document, "code": code, "setup": variant.function,
                           "directory": str(directory)})
    return listed


@dataclass(frozen=True)
class Run:
    """The snippets' process: its job ids, what it said about each, and its output."""

    ids: list[str]
    outcomes: dict[str, str | None]
    done: subprocess.CompletedProcess | None   # None: it ran past TIMEOUT_S

    def problems(self, document: str) -> list[str]:
        problems = []
        for id_ in (i for i in self.ids if i.startswith(f"{document}:")):
            if id_ not in self.outcomes:
                problems.append(f"{id_}: not run (the process stopped: {self.stopped()})")
            elif self.outcomes[id_] is not None:
                problems.append(f"{id_} failed:\n{self.outcomes[id_][-4000:]}")
        return problems

    def stopped(self) -> str:
        if self.done is None:
            return f"past {TIMEOUT_S} s"
        return f"exit status {self.done.returncode}\n{self.done.stderr[-3000:]}"


def run_snippets(found: list[Snippet], workdir: Path) -> Run:
    listed = jobs(found, workdir)
    (workdir / "jobs.json").write_text(json.dumps(listed))
    outcomes_path = workdir / "outcomes.json"
    # No accelerator, even where there is one: the snippets are read for the CPU. Nothing downloaded.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(workdir / "datasets-cache"), "WANDB_DISABLED": "true"}
    try:
        done = subprocess.run([sys.executable, "-m", "tests.doc_snippets", str(workdir / "jobs.json"),
                               str(outcomes_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        done = None
    outcomes = json.loads(outcomes_path.read_text()) if outcomes_path.exists() else {}
    return Run([job["id"] for job in listed], outcomes, done)


def runnable_documents() -> list[Path]:
    return [d for d in documents() if any(s.fragment is None for s in snippets(doc_id(d), d.read_text()))]


@pytest.fixture(scope="module")
def snippets_run(request, tmp_path_factory):
    # One process for every document this session tests: the imports (torch, transformers) are paid once.
    selected = {item.callspec.params["document"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_snippets_run"}
    found = [s for d in runnable_documents() if d in selected for s in snippets(doc_id(d), d.read_text())]
    return run_snippets(found, tmp_path_factory.mktemp("snippets"))


@pytest.mark.parametrize("document", documents(), ids=doc_id)
def test_snippets_are_marked(document):
    problems = marker_problems(snippets(doc_id(document), document.read_text()))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("document", runnable_documents(), ids=doc_id)
def test_snippets_run(document, snippets_run):
    problems = snippets_run.problems(doc_id(document))
    assert not problems, "\n".join(problems)


def test_every_setup_and_replacement_is_used():
    # A setup no snippet names, or a replacement that no longer matches (a snippet would then run
    # at full size), is left over from an edit of the docs.
    found = [s for d in documents() for s in snippets(doc_id(d), d.read_text())]
    assert sorted(set(SETUPS) - {s.setup for s in found}) == []
    unmatched = [(name, old) for name, variants in SETUPS.items() for variant in variants for old, _ in variant.replace
                 if not any(s.setup == name and old in s.code for s in found)]
    assert unmatched == []


def stated_signatures(code: str) -> list[tuple[str, list[tuple[str, Any]]]]:
    """The signatures a fragment states, as (the public name, its parameters as (name, default or
    :data:`REQUIRED`)): ``class Name: def __init__(...)``, ``def name(...)`` and ``Name(a, b=1)``."""
    stated = []
    for node in ast.parse(code).body:
        if isinstance(node, ast.ClassDef):
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name == "__init__":
                    stated.append((node.name, _parameters(method.args)[1:]))  # without self
        elif isinstance(node, ast.FunctionDef):
            stated.append((node.name, _parameters(node.args)))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            call = node.value
            stated.append((call.func.id, [(a.id, REQUIRED) for a in call.args if isinstance(a, ast.Name)]
                           + [(k.arg, ast.literal_eval(k.value)) for k in call.keywords if k.arg]))
    return stated


REQUIRED = object()


def _parameters(args: ast.arguments) -> list[tuple[str, Any]]:
    positional = [*args.posonlyargs, *args.args]
    defaults = [REQUIRED] * (len(positional) - len(args.defaults)) + [ast.literal_eval(d) for d in args.defaults]
    listed = [(a.arg, d) for a, d in zip(positional, defaults)]
    listed += [(a.arg, REQUIRED if d is None else ast.literal_eval(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return listed + ([("**" + args.kwarg.arg, REQUIRED)] if args.kwarg else [])


def actual_parameters(name: str) -> list[tuple[str, Any]]:
    import inspect

    import offload

    target = getattr(offload, name)
    signature = inspect.signature(target.__init__ if isinstance(target, type) else target)
    return [(("**" if p.kind is p.VAR_KEYWORD else "") + p.name, REQUIRED if p.default is p.empty else p.default)
            for p in signature.parameters.values() if p.name != "self"]


@pytest.mark.parametrize("document", documents(), ids=doc_id)
def test_the_signatures_the_docs_state_are_the_librarys(document):
    # A fragment that states a public class's or function's signature names every parameter, in
    # order, with its default: an argument added to the code and not to the docs is caught here.
    for snippet in snippets(doc_id(document), document.read_text()):
        if snippet.fragment is None:
            continue
        for name, stated in stated_signatures(snippet.code):
            assert stated == actual_parameters(name), f"{snippet.name}: {name}'s signature"


def test_the_checks_catch_what_they_are_for(tmp_path):
    # Each check reports a planted mistake, so the tests above can fail.
    text = ("```python\nloader\n```\n\n<!-- fragment: a signature -->\n```python\ndef f(x): ...\n```\n"
            "<!-- fragment: -->\n```python\nf(\n```\n<!-- snippet-setup: no-such -->\n```python\npass\n```\n"
            "<!-- snippet-setup: model -->\n```python\nimport torch\nmodel(torch.zeros(2, 16, device=\"cuda\"))\n```\n")
    found = snippets("planted.md", text)
    assert [(s.setup, s.fragment) for s in found] == [(None, None), (None, "a signature"), (None, ""),
                                                       ("no-such", None), ("model", None)]
    problems = marker_problems(found)
    assert len(problems) == 3 and "says why" in problems[0] and "compile" in problems[1] and "no-such" in problems[2]
    # A snippet has its page's earlier imports, and no setup's: the same code on a page of its own
    # (run after the other, so nothing carries over from one page to the next) fails.
    imports = "<!-- snippet-setup: layers -->\n```python\nimport torch\nfrom offload import OffloadModel\n```\n"
    continued = ("<!-- snippet-setup: layers -->\n```python\nmodel = OffloadModel(layers, device=\"cuda\", "
                 "num_slices=2)\nmodel(torch.zeros(2, 16)).sum().backward()\n```\n")
    ran = run_snippets([found[0], found[1], found[4], *snippets("continued.md", imports + continued),
                        *snippets("alone.md", continued)], tmp_path)
    assert ran.ids == ["planted.md:1 (python snippet 0) [setup none]", "planted.md:18 (python snippet 4) [setup model]",
                       "continued.md:2 (python snippet 0) [setup layers]",
                       "continued.md:7 (python snippet 1) [setup layers]",
                       "alone.md:2 (python snippet 0) [setup layers]"]
    assert ran.done.returncode == 1
    assert "NameError: name 'loader' is not defined" in ran.outcomes[ran.ids[0]]
    assert ran.outcomes[ran.ids[1]] is None, ran.outcomes[ran.ids[1]]   # on the CPU, with its setup
    assert ran.problems("continued.md") == [], ran.problems("continued.md")
    assert "NameError: name 'OffloadModel' is not defined" in ran.outcomes[ran.ids[4]]
    assert len(ran.problems("planted.md")) == 1 and ran.problems("other.md") == []
    # A setup that gave an import would hide a snippet that forgets it.
    with pytest.raises(ValueError, match="torch"):
        reader_names({"layers": None, "torch": None}, "planted")
    # A stated signature that leaves a parameter out, or states another default, differs.
    stated = stated_signatures("class OffloadOptimizer:\n    def __init__(self, model, optimizer_class): ...\n"
                               "def latest_checkpoint(directory=None): ...\nOffloadModel(model, device)\n")
    assert [name for name, _ in stated] == ["OffloadOptimizer", "latest_checkpoint", "OffloadModel"]
    assert all(parameters != actual_parameters(name) for name, parameters in stated)
    assert stated_signatures("def latest_checkpoint(directory): ...")[0][1] == actual_parameters("latest_checkpoint")
