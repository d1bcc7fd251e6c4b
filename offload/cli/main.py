"""``offload``: the package's command, dispatching to its subcommands.

``offload plan ...`` (``offload/cli/plan.py``), ``offload calibrate ...`` (``offload/cli/calibrate.py``)
and ``offload finetune ...`` (the ``offload-finetune`` program); also ``python -m offload ...``.
"""

from __future__ import annotations

import os
import sys

from .invocation import invoked_as

COMMANDS = {
    "plan": "will a model fit, how fast is a step, and with which configuration",
    "calibrate": "measure this machine's rates for plan (about a minute)",
    "finetune": "fine-tune a Hugging Face causal LM (the offload-finetune program)",
}


def main(argv: list[str] | None = None) -> None:
    # Started from the command line, the program names itself as it was started (``python -m
    # offload``): the resume command a stopped ``finetune`` prints must run as printed.
    program = "offload" if argv is not None else invoked_as("offload")
    try:
        _dispatch(sys.argv[1:] if argv is None else list(argv), program)
        sys.stdout.flush()  # a reader gone (``| head``) raises here, inside the handler, not at exit
    except BrokenPipeError:
        # The reader stopped reading: nothing more to say to it, and no traceback. Python's own
        # flush at exit would fail again on the closed pipe: point stdout at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(1) from None


def _dispatch(argv: list[str], program: str) -> None:
    usage = "usage: offload COMMAND [options]  (offload COMMAND --help for its options)"
    commands = "\n".join(f"  {name:<10} {what}" for name, what in COMMANDS.items())
    if argv and argv[0] in ("-h", "--help"):
        print(f"{usage}\n\ncommands:\n{commands}")
        return
    if not argv or argv[0] not in COMMANDS:
        # As argparse answers a missing or invalid choice: the usage and the error on stderr, exit
        # status 2 (a script tells a mistyped command from a run that failed).
        what = "a COMMAND is required" if not argv else f"unknown command {argv[0]!r}"
        print(f"{usage}\noffload: error: {what}: choose from {', '.join(COMMANDS)}", file=sys.stderr)
        raise SystemExit(2)
    command, rest = argv[0], argv[1:]
    if command == "plan":
        from .plan import main as run
    elif command == "calibrate":
        from .calibrate import main as run
    else:
        from .finetune import main as finetune

        finetune(rest, program=f"{program} finetune")  # its usage and resume line start it this way
        return
    run(rest)
