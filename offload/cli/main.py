"""``offload``: the package's command, dispatching to its subcommands.

``offload plan ...`` (``offload/cli/plan.py``), ``offload calibrate ...`` (``offload/cli/calibrate.py``)
and ``offload finetune ...`` (the ``offload-finetune`` program); also ``python -m offload ...``.
"""

from __future__ import annotations

import sys

COMMANDS = {
    "plan": "will a model fit, how fast is a step, and with which configuration",
    "calibrate": "measure this machine's rates for plan (about a minute)",
    "finetune": "fine-tune a Hugging Face causal LM (the offload-finetune program)",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        usage = "\n".join(f"  {name:<10} {what}" for name, what in COMMANDS.items())
        print(f"usage: offload COMMAND [options]  (offload COMMAND --help for its options)\n\ncommands:\n{usage}")
        if argv and argv[0] not in ("-h", "--help"):
            raise SystemExit(f"unknown command {argv[0]!r}")
        return
    command, rest = argv[0], argv[1:]
    if command == "plan":
        from .plan import main as run
    elif command == "calibrate":
        from .calibrate import main as run
    else:
        from .finetune import main as run
    run(rest)
