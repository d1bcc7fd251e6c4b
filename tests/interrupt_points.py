"""Ctrl-C injected at chosen points of chosen frames, for the tests that sweep every point where one
could land: a trace function counts the points as the code under test passes them and raises
``KeyboardInterrupt`` at the N-th, so a sweep (count once, then interrupt at each point in turn) is
deterministic where a real signal's timing is not.

Two ways to count, both on the calling thread only (``sys.settrace``: another thread runs untraced):

- :class:`SignalChecks`: the places where CPython 3.11 checks for signals, in the frames of given
  code objects, within a window of the run (the hand-off of one update, say);
- :class:`LineEvents`: the calls and lines of functions picked by file and name, a coarser
  stand-in for the same places, with no window.

:func:`traced` installs either for a block; :func:`print_sweep` and :func:`run_sweep` run a sweep
in a subprocess with a time limit (a worker left locked hangs it), :func:`run_python` any other
code. The scenarios swept, and what each test asserts of the outcome, stay in the test files.
"""

from __future__ import annotations

import dis
import json
import linecache
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from inspect import CO_GENERATOR as GENERATOR
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

Trace = Callable[[FrameType, str, Any], Any]


@contextmanager
def traced(trace: Trace) -> Iterator[Trace]:
    """Install ``trace`` on this thread for the block, then no trace function at all."""
    sys.settrace(trace)
    try:
        yield trace
    finally:
        sys.settrace(None)


def never(frame: FrameType) -> bool:
    return False


class SignalChecks:
    """A trace function that raises KeyboardInterrupt at point ``at`` of a window of a run, and lists
    the points it passed (``at=-1``: it only lists them).

    The points are where CPython 3.11 checks for signals, in the frames of ``codes``: the start of a
    function they call (a generator aside), the instruction after a call that ran C code, a jump
    back. Not at a line's start: the line that leaves a ``with`` block starts before its
    ``__exit__`` is called, and no signal lands there.

    The window opens at the first call that ``opens`` picks and closes for good at a later call
    that ``closes`` picks, or as a frame returns: the opening one, or where ``returns_from`` is
    given, the nearest frame up the stack from it that runs one of those codes. With
    ``real_signal``, the interrupt is a SIGINT sent to this process, which Python's own handler
    raises at its next check (in :meth:`point`), as a Ctrl-C would.
    """

    def __init__(self, codes: Iterable[CodeType], opens: Callable[[FrameType], bool], *,
                 closes: Callable[[FrameType], bool] = never, returns_from: Collection[CodeType] = (),
                 at: int = -1, real_signal: bool = False) -> None:
        self.codes, self.opens, self.closes, self.returns_from = set(codes), opens, closes, set(returns_from)
        self.at, self.real_signal = at, real_signal
        self.points: list[str] = []
        self.state = "before"  # then "open", then "done"
        self.last: FrameType | None = None  # the frame whose return closes the window, while open
        self.checks: dict[FrameType, str] = {}  # a traced frame's check due at its next instruction

    @property
    def fired(self) -> str | None:
        """The point it raised at, if it reached it."""
        return self.points[self.at] if 0 <= self.at < len(self.points) else None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Trace | None:
        if self.state == "done":  # nothing more to list: leave the rest of the run untraced
            return None
        if self.state == "before" and self.opens(frame):
            self.state, self.last = "open", self._last_of(frame)
        elif self.state == "open" and self.closes(frame):
            self.state = "done"
        elif (self.state == "open" and frame.f_back is not None and frame.f_back.f_code in self.codes
              and not frame.f_code.co_flags & GENERATOR):
            self.checks.pop(frame.f_back, None)  # it called Python code: no check as that returns
            self.point(f"start of {frame.f_code.co_qualname}, called from {frame.f_back.f_code.co_qualname}")
        if frame.f_code not in self.codes:
            return None
        # Traced before the window opens too: a caller of the opening frame has points once it returns.
        frame.f_trace_opcodes = True
        return self.local

    def _last_of(self, frame: FrameType) -> FrameType | None:
        if not self.returns_from:
            return frame
        last: FrameType | None = frame
        while last is not None and last.f_code not in self.returns_from:
            last = last.f_back
        return last

    def local(self, frame: FrameType, event: str, arg: Any) -> Trace | None:
        if self.state == "done":
            return None
        if self.state == "before":
            return self.local
        if event == "return" and frame is self.last:
            self.state = "done"
        if event != "opcode":
            return self.local
        due = self.checks.pop(frame, None)
        if due is not None:
            self.point(due)
        name = dis.opname[frame.f_code.co_code[frame.f_lasti]]
        if name in ("CALL", "JUMP_BACKWARD"):
            self.checks[frame] = f"after {name} in {frame.f_code.co_qualname}:{frame.f_lineno}"
        return self.local

    def point(self, where: str) -> None:
        self.points.append(where)
        if len(self.points) - 1 == self.at:
            self.state = "done"
            if self.real_signal:  # Ctrl-C: Python's handler raises at the next check, in this function
                os.kill(os.getpid(), signal.SIGINT)
            raise KeyboardInterrupt(where)


class LineEvents:
    """A trace function that raises KeyboardInterrupt at event ``at`` (counted from 1 over the calls
    and lines of the functions ``functions`` picks: a file to the names of its functions traced,
    ``None`` for all of them), as a signal handler would; ``at=0`` only counts."""

    def __init__(self, functions: Mapping[str, Collection[str] | None], at: int = 0) -> None:
        self.functions, self.at = functions, at
        self.count = 0
        self.fired: tuple[str, str, int, str] | None = None  # where: file, function, line, event

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Trace | None:
        code = frame.f_code
        if code.co_filename not in self.functions:
            return None
        names = self.functions[code.co_filename]
        if names is not None and code.co_name not in names:
            return None
        self._hit(frame, event)
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Trace:
        # Python checks for a signal as a function starts, as a loop turns and as a call returns:
        # never at the no-op that marks where a try begins, nor as a with statement's exit starts
        # (a lock's: an interrupt raised there would leave it held, which no signal can).
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if event == "line" and source != "try:" and not source.startswith("with "):
            self._hit(frame, event)
        return self._line

    def _hit(self, frame: FrameType, event: str) -> None:
        self.count += 1
        if self.count == self.at:
            self.fired = (frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno, event)
            raise KeyboardInterrupt


def run_python(code: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with ``args`` in a fresh interpreter at the repository's root; one still running
    after ``timeout`` seconds fails the test with what it wrote."""
    try:
        return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    except subprocess.TimeoutExpired as hung:
        raise AssertionError(f"still running after {timeout} s: {hung.stdout!r} {hung.stderr!r}") from None


def print_sweep(interrupted_at: Callable[[int], dict[str, Any]]) -> None:
    """Interrupt a run at each of its points in turn: ``interrupted_at(at)`` runs it interrupted at
    point ``at`` (``-1``: not at all) and returns the ``points`` it listed, the point it raised at
    (``where``) and what ``ran``. Prints them as one line of JSON, for :func:`run_sweep`."""
    points = interrupted_at(-1)["points"]
    outcomes = [interrupted_at(at) for at in range(len(points))]
    print(json.dumps({"points": points, "outcomes": [(o["where"], o["ran"]) for o in outcomes]}))


def run_sweep(code: str, *args: str, timeout: float) -> list[tuple[str, Any]]:
    """Run ``code`` (which calls :func:`print_sweep`) in a subprocess: each point and what ran when
    interrupted there, once it exited, having reached and raised at every point it listed."""
    done = run_python(code, *args, timeout=timeout)
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert [where for where, _ in result["outcomes"]] == result["points"]  # each point was reached, and raised
    return [(where, ran) for where, ran in result["outcomes"]]


#: Run by :func:`run_python_each`: imports torch once (nothing of the package), then, for each
#: argument, forks a child that runs the code as a fresh interpreter would run it with that argument
#: (in ``__main__``, its output in files of its own, ending as an interpreter ends: finalizers run).
_EACH = """
import json, os, sys, traceback
import torch
_code, _outputs, _args = sys.argv[1], sys.argv[2], sys.argv[3:]
_statuses = {}
for _k, _arg in enumerate(_args):
    sys.stdout.flush()
    sys.stderr.flush()
    _pid = os.fork()
    if _pid == 0:
        os.dup2(os.open(os.path.join(_outputs, f"{_k}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(os.path.join(_outputs, f"{_k}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.argv = ["-c", _arg]
        try:
            exec(compile(_code, "<string>", "exec"), vars(sys.modules["__main__"]))
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)
    _statuses[_arg] = os.waitstatus_to_exitcode(os.waitpid(_pid, 0)[1])
print(json.dumps(_statuses))
"""


def run_python_each(code: str, args: list[str], *, timeout: float) -> dict[str, subprocess.CompletedProcess[str]]:
    """:func:`run_python` of ``code`` with each one of ``args``, in one subprocess that imports torch
    once and forks a child per argument (each as fresh as its own interpreter: nothing of the
    package imported before it). One still running after ``timeout`` seconds in all fails the test."""
    import tempfile

    with tempfile.TemporaryDirectory() as outputs:
        done = run_python(_EACH, code, outputs, *args, timeout=timeout)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        statuses = json.loads(done.stdout.splitlines()[-1])
        return {arg: subprocess.CompletedProcess(
                    [sys.executable, "-c", code, arg], statuses[arg],
                    Path(outputs, f"{k}.out").read_text(), Path(outputs, f"{k}.err").read_text())
                for k, arg in enumerate(args)}
