"""The fine-tune command names itself as it was started: ``offload-finetune``, ``offload finetune``,
``python -m offload finetune``, ``python -m offload.cli.finetune``, ``python
scripts/finetune_causal_lm.py``, or a console script's path where the PATH does not lead to it. The
resume command a stopped run prints starts it that way, and runs as printed (one subprocess runs two
of them); its usage and errors name it that way too. And the line of a run stopped while its first
checkpoint was being saved.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import types
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import offload.cli.main  # noqa: E402
from offload.cli import finetune as cli  # noqa: E402
from offload.cli import invocation  # noqa: E402
from offload.cli.invocation import invoked_as, python_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Where the console scripts are installed, beside this interpreter.
BIN = Path(sys.executable).parent
TINY = ["--device", "cpu", "--no-progress", "--batch-size", "2", "--seq-len", "16", "--num-slices", "3"]
PY = "{python}"  # python_command() in the expected programs below

#: Each way of starting the command: sys.argv[0], the ``-m`` module (``__main__``'s spec), whether
#: ``offload``'s dispatcher runs it (``finetune`` first in its arguments), and the program it prints.
WAYS = {
    "offload-finetune": (str(BIN / "offload-finetune"), None, False, "offload-finetune"),
    "offload finetune": (str(BIN / "offload"), None, True, "offload finetune"),
    "python -m offload finetune": (str(ROOT / "offload" / "__main__.py"), "offload.__main__", True,
                                   f"{PY} -m offload finetune"),
    "python -m offload.cli.finetune": (str(ROOT / "offload" / "cli" / "finetune.py"), "offload.cli.finetune", False,
                                       f"{PY} -m offload.cli.finetune"),
    "script": ("scripts/finetune_causal_lm.py", None, False, f"{PY} scripts/finetune_causal_lm.py"),
}


def started(monkeypatch: pytest.MonkeyPatch, way: str, args: list[str]) -> str:
    """Make this process look started ``way`` with ``args``, by a shell that found a console script
    on the PATH; the program it should name."""
    first, module, dispatched, program = WAYS[way]
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    main_module = types.ModuleType("__main__")
    main_module.__spec__ = None if module is None else ModuleSpec(module, None)
    monkeypatch.setitem(sys.modules, "__main__", main_module)
    monkeypatch.setattr(sys, "argv", [first, *(["finetune"] if dispatched else []), *args])
    return program.format(python=python_command())


def run_as_started(way: str) -> None:
    """The entry point ``way`` runs, on the command line's arguments (``argv`` left out)."""
    (offload.cli.main.main if WAYS[way][2] else cli.main)()


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_stopped_run_prints_the_resume_command_that_starts_it_the_same_way(way, tmp_path, monkeypatch, capsys):
    args = [*TINY, "--out", str(tmp_path / "o u t"), "--steps", "1", "--save-every", "1"]
    program = started(monkeypatch, way, args)

    def interrupted(*rest):
        raise KeyboardInterrupt  # Ctrl-C in the export, after the last checkpoint

    monkeypatch.setattr(cli, "_save", interrupted)
    with pytest.raises(SystemExit) as stop:
        run_as_started(way)
    assert stop.value.code == 130
    checkpoint = tmp_path / "o u t" / "checkpoints" / "step-1"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"interrupted after step 1; last checkpoint: {checkpoint}; resume with: {program} "
                    f"{shlex.join([*args, '--resume', str(checkpoint)])}")


@pytest.mark.parametrize("way", sorted(WAYS))
def test_usage_and_errors_name_the_program_as_it_was_started(way, tmp_path, monkeypatch, capsys):
    program = started(monkeypatch, way, ["--help"])
    with pytest.raises(SystemExit) as stop:
        run_as_started(way)
    usage = " ".join(capsys.readouterr().out.split())  # argparse wraps a long program's usage
    assert stop.value.code == 0 and usage.startswith(f"usage: {program} [-h]"), usage[:200]
    program = started(monkeypatch, way, ["--out", str(tmp_path), "--steps", "0"])
    with pytest.raises(SystemExit) as stop:
        run_as_started(way)
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"{program}: error: --steps must be at least 1"
    # An error the run finds after parsing (fail()): the same name.
    (tmp_path / "file").write_text("")
    program = started(monkeypatch, way, ["--device", "cpu", "--out", str(tmp_path / "file" / "out")])
    with pytest.raises(SystemExit) as stop:
        run_as_started(way)
    assert str(stop.value.code).startswith(f"{program}: error: --out {tmp_path / 'file' / 'out'}: cannot write there")


def test_python_is_named_by_its_path_when_python_on_the_path_is_another(monkeypatch):
    monkeypatch.setattr(invocation.shutil, "which", lambda name: sys.executable)
    assert python_command() == "python"
    monkeypatch.setattr(invocation.shutil, "which", lambda name: "/elsewhere/bin/python")
    assert python_command() == shlex.quote(sys.executable)
    monkeypatch.setattr(invocation.shutil, "which", lambda name: None)
    assert python_command() == shlex.quote(sys.executable)


@pytest.mark.parametrize("way", ["offload-finetune", "offload finetune"])
def test_a_console_script_the_path_does_not_lead_to_is_named_by_the_path_it_was_started_by(way, tmp_path, monkeypatch,
                                                                                           capsys):
    """A job that runs ``.venv/bin/offload-finetune`` without the environment on its PATH printed a
    resume command starting ``offload-finetune``, which its shell did not find ("not found"), or
    found as another installation. The program is the path it was started by, quoted for a shell."""
    script, _, dispatched, _ = WAYS[way]
    name, command = Path(script).name, " finetune" if dispatched else ""
    other = tmp_path / "other env"  # another installation, first on the PATH
    other.mkdir()
    (other / name).write_text("#!/bin/sh\n")
    (other / name).chmod(0o755)
    args = [*TINY, "--out", str(tmp_path / "o u t"), "--steps", "1", "--save-every", "1"]
    monkeypatch.setattr(cli, "_save", lambda *rest: (_ for _ in ()).throw(KeyboardInterrupt))
    for path in (str(tmp_path / "nothing"), f"{other}{os.pathsep}{BIN}"):
        started(monkeypatch, way, args)
        monkeypatch.setenv("PATH", path)
        with pytest.raises(SystemExit):
            run_as_started(way)
        checkpoint = tmp_path / "o u t" / "checkpoints" / "step-1"
        command_line = capsys.readouterr().err.strip().splitlines()[-1].split("; resume with: ")[1]
        resumed = shlex.join([*args, "--resume", str(checkpoint)])
        assert command_line == f"{shlex.quote(script)}{command} {resumed}", path
        shutil.rmtree(tmp_path / "o u t")
    # A path that needs quoting is quoted.
    spaced = str(tmp_path / "my env" / "bin" / name)
    started(monkeypatch, way, ["--help"])
    monkeypatch.setattr(sys, "argv", [spaced])
    assert invoked_as(name) == shlex.quote(spaced) and shlex.split(invoked_as(name)) == [spaced]


def test_a_process_started_otherwise_names_the_default(monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert invoked_as("offload-finetune") == "offload-finetune"
    monkeypatch.setattr(sys, "argv", [])
    assert invoked_as("offload") == "offload"


def test_the_printed_resume_commands_run_as_printed(tmp_path, monkeypatch, capsys):
    """``offload finetune`` and ``python -m offload finetune`` printed commands that did not run
    (``offload --out ...``: an unknown command; ``python .../offload/__main__.py``: an ImportError).
    Each stopped run's command, run by a shell as printed, finishes it."""
    monkeypatch.setattr(cli, "_save", lambda *rest: (_ for _ in ()).throw(KeyboardInterrupt))
    commands = []
    for way, out in (("offload finetune", tmp_path / "a"), ("python -m offload finetune", tmp_path / "b")):
        started(monkeypatch, way, [*TINY, "--out", str(out), "--steps", "1", "--save-every", "1"])
        with pytest.raises(SystemExit):
            run_as_started(way)
        commands.append(capsys.readouterr().err.strip().splitlines()[-1].split("; resume with: ")[1])
    # The console scripts sit beside this interpreter; a shell finds them on the PATH.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(" && ".join(commands), shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("nothing left to train after step 1; saved to") == 2, done.stdout[-3000:]
    assert all((out / "model.safetensors.index.json").is_file() for out in (tmp_path / "a", tmp_path / "b"))


def test_a_run_stopped_while_its_first_checkpoint_was_saved_says_so(tmp_path, monkeypatch, capsys):
    """Not "no checkpoint was saved (--save-every N saves one every N steps)": --save-every was given."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "save_checkpoint", interrupted)
    with pytest.raises(SystemExit) as stop:
        cli.main([*TINY, "--out", str(tmp_path), "--steps", "3", "--save-every", "2"])
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted after step 2; no checkpoint was saved: the first, step-2, was being saved and did not complete, "
        "so none was kept")
