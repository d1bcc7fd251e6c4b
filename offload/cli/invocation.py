"""How this process's program was started, as a command line that starts it again.

A program prints itself in its usage and in the command that resumes a stopped run
(``offload/cli/outputs.py``), and a line to paste must start the program the way the user did:
``offload-finetune``, ``offload finetune`` (or the path they were started by, where the PATH
does not find them), ``python -m offload finetune``, ``python -m offload.cli.finetune`` or ``python
scripts/finetune_causal_lm.py``. ``sys.argv[0]`` alone does not say it: under ``-m`` it is the
module's file, which run as a script cannot import its package.
It imports nothing heavy: ``offload --help`` reads it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

__all__ = ["invoked_as", "python_command"]


def python_command() -> str:
    """``python`` when that name on the PATH is this interpreter, else this interpreter's path:
    another ``python`` (the system's, outside this virtual environment) may lack the package."""
    found = shutil.which("python")
    if found is not None and os.path.abspath(found) == os.path.abspath(sys.executable):
        return "python"
    return shlex.quote(sys.executable) if sys.executable else "python"


def invoked_as(default: str) -> str:
    """The command that started this process's program, ready for a shell; ``default`` where the
    process was started another way (``python -c``, an embedding).

    Read from ``__main__``'s module spec (``python -m NAME``: the package for ``NAME.__main__``) and
    from ``sys.argv[0]`` (a ``.py`` file run by the interpreter, or an installed script). An
    installed script is named bare only where that name on the PATH is this script: one started by
    its path (a job script, cron, a virtual environment not activated) is named by that path, as
    started, since a shell would not find the bare name, or would find another installation's.
    Call it only for a program run from the command line, with ``sys.argv`` its own.
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"{python_command()} -m {spec.name.removesuffix('.__main__')}"
    first = sys.argv[0] if sys.argv else ""
    if first.endswith(".py"):
        return f"{python_command()} {shlex.quote(first)}"
    if not first or first.startswith("-"):  # python -c, or an interpreter embedded without arguments
        return default
    name = Path(first).name
    found = shutil.which(name)
    if found is not None and os.path.realpath(found) == os.path.realpath(first):
        return name
    return shlex.quote(first)
