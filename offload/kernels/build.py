"""Compiles ``one_pass.cpp`` for this machine, once, in the background, and checks it against
PyTorch's fused kernel before anything uses it.

The build takes tens of seconds (PyTorch's headers are large), so it runs on a thread of its own
from the first update that could use it; until it is ready, and for good when it cannot be built
or its check fails, :func:`host_kernel` returns ``None`` and the update runs PyTorch's kernel and
a separate cast, which gives the same bits. The compiled module is cached across processes in
PyTorch's extension directory (``TORCH_EXTENSIONS_DIR``), under a name that changes with the
source, the flags, the compiler and the PyTorch install, and is built from a copy of the source kept
in that directory (Note: [One build per source]). ``OFFLOAD_HOST_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

try:
    import fcntl
except ImportError:  # not on Windows: stale locks are then judged by their age alone
    fcntl = None  # type: ignore[assignment]

SOURCE = Path(__file__).with_name("one_pass.cpp")

#: The flags PyTorch builds each CPU capability's kernels with: the compiler then makes the same
#: choices (which multiply-adds it fuses) for the same expressions.
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

#: Marks of the line in a failed build's message that says what went wrong: PyTorch's message ends
#: with ninja's "build stopped: subcommand failed.", which says nothing of the cause.
ERROR_MARKS = (": error:", "fatal error", "not found", "cannot find")

#: A lock file older than this is a build that died (a killed process leaves it behind, and
#: PyTorch's loader would wait on it for ever).
STALE_LOCK_SECONDS = 600

_lock = threading.Lock()
_state: dict[str, object] = {"module": None, "thread": None, "note": None, "exiting": False}
#: How long the interpreter's exit waits for a build under way (a first build takes about 35 s on
#: two cores; a cached one well under a second): a daemon thread the interpreter stops inside
#: PyTorch's or the kernel's C++ code aborts the process.
EXIT_WAIT_SECONDS = 300
#: After this long, the wait says on stderr what it waits for.
EXIT_NOTE_SECONDS = 3.0


class HostKernelUnavailable(RuntimeWarning):
    """The one-pass host update cannot run here; the update runs PyTorch's kernels instead."""


def host_kernel(wait: bool = False) -> ModuleType | None:
    """The compiled, checked kernel module, or ``None`` while it builds (``wait``: until it is
    built) and when it cannot be used on this machine (a one-line :class:`HostKernelUnavailable`
    warning says why, once)."""
    if os.environ.get("OFFLOAD_HOST_KERNELS", "1") == "0":
        return None
    with _lock:
        module = _state["module"]
        if module is not None or _state["note"] is not None:
            return module  # type: ignore[return-value]
        thread = _state["thread"]
        if thread is None:
            if _exit_begun():
                return None  # a build begun now could not finish (PyTorch's kernels serve the update)
            thread = threading.Thread(target=_build, name="offload host kernel build", daemon=True)
            _state["thread"] = thread
            thread.start()
    if wait:
        thread.join()  # type: ignore[attr-defined]
    return _state["module"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why the kernel is not used here (``None`` while it builds, or when it is ready)."""
    return _state["note"]  # type: ignore[return-value]


def _exit_begun() -> bool:
    """Whether the interpreter has begun to exit (an update worker's exit handler may then finish a
    step and ask for the kernel): the exit handlers run once the main thread has stopped and every
    other thread that is not a daemon has ended (training on such a thread goes on past the main
    thread's end)."""
    if _state["exiting"] or sys.is_finalizing():
        return True
    main = threading.main_thread()
    return not main.is_alive() and not any(not t.daemon and t.is_alive() for t in threading.enumerate()
                                           if t is not main)


def _build() -> None:
    try:
        with _lock:
            if _state["exiting"]:
                return
        module = _compile()
        from .check import check_against_torch
        with _lock:
            if _state["exiting"]:
                return  # nothing will use it: the exit need not wait for the check
        mismatch = check_against_torch(module)
        if mismatch is not None:
            raise RuntimeError(f"it differs from PyTorch's fused kernel on this machine ({mismatch})")
    except Exception as error:  # no compiler, no headers, a failed check: PyTorch's kernels, same results
        note = _reason(error)
        _state["note"] = note
        warnings.warn(f"offload: the one-pass host update is off on this machine ({note}); updates run PyTorch's "
                      "fused kernel and a separate cast, with the same results", HostKernelUnavailable, stacklevel=1)
        return
    _state["module"] = module


def _reason(error: Exception) -> str:
    """One line saying why the kernel is off: the line of a build's many that names the cause (the
    compiler's error, a missing program or header), else the message's last."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = next((line for line in lines if any(mark in line for mark in ERROR_MARKS)), lines[-1] if lines else "")
    return f"{type(error).__name__}: {cause}"


@atexit.register
def _finish_build_at_exit() -> None:
    """At exit, let a build under way end and let none begin. Every step of a build can be inside
    C++ code when the interpreter stops its thread, which then aborts the process ("terminate
    called without an active exception"): importing PyTorch's extension tools, loading the
    compiled module, the check's kernels. A build that has not reached its check skips it.
    Registered on import, not by the first :func:`host_kernel` call: that call may come from
    another exit handler (an update worker finishing its work), when a handler registered then
    would never run; :func:`host_kernel` begins no build once the exit has begun."""
    with _lock:
        _state["exiting"] = True
        thread = _state["thread"]
    if thread is None or not thread.is_alive():  # type: ignore[attr-defined]
        return
    thread.join(EXIT_NOTE_SECONDS)  # type: ignore[attr-defined]
    if thread.is_alive():  # type: ignore[attr-defined]
        print(f"offload: waiting for the one-pass host kernel's build to end before exiting (once per machine and "
              f"PyTorch version; at most {EXIT_WAIT_SECONDS} s; OFFLOAD_HOST_KERNELS=0 turns the kernel off)",
              file=sys.stderr, flush=True)
        thread.join(EXIT_WAIT_SECONDS)  # type: ignore[attr-defined]


def _compile() -> ModuleType:
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CAPABILITY_FLAGS:
        raise RuntimeError(f"no build for CPU capability {capability}")
    # OpenMP as PyTorch's own kernels use it: without it at::parallel_for runs on one thread. The
    # runtime is the one PyTorch loaded (the same soname), so torch.set_num_threads sets its threads.
    flags = ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
             *CAPABILITY_FLAGS[capability]]
    compiler = cpp_extension.get_cxx_compiler()
    source = SOURCE.read_bytes()
    name = f"offload_one_pass_{_digest(source, flags, compiler)}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    with _builders_lock(build_dir) as exclusive:
        _clear_left_lock(build_dir, exclusive)
        copy = _source_copy(build_dir, source)
        # A build already made loads without a compiler (ninja finds nothing to do); a new one would
        # fail in ninja with the cause buried in its output.
        if not (build_dir / f"{name}{cpp_extension.LIB_EXT}").exists() and not _found(compiler):
            raise RuntimeError(f"no C++ compiler ({compiler}) found: install one, or name it in CXX")
        return cpp_extension.load(name=name, sources=[str(copy)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                  verbose=False)


# Note: [One build per source]
# PyTorch's builder writes every command into the build directory's build.ninja, and ninja rebuilds
# a target whose command changed (35-80 s on two cores). The commands hold the source's path, the compiler,
# and the include and library paths of the PyTorch and the Python in use. So:
# 1. The build compiles the directory's own copy of one_pass.cpp, never the installed file: two
#    installs of the same version (a second clone, a worktree, a CI checkout) sharing
#    TORCH_EXTENSIONS_DIR find the same commands, and the second loads the first one's build
#    instead of recompiling on every switch between them.
# 2. The directory's name is a digest of all the rest (source, flags, compiler, the PyTorch install
#    and its version, Python's headers), so two virtual environments each keep a build of their own
#    rather than take turns rebuilding one.
# 3. The copy is written once, whole (under a name of its own, then renamed into place), and left
#    alone while its bytes are right: ninja also rebuilds from a source newer than its object.


def _digest(source: bytes, flags: list[str], compiler: str) -> str:
    """The build's name: a digest of what its commands hold but the source's path (Note: [One build
    per source], rule 2)."""
    parts = [source, *(part.encode() for part in (" ".join(flags), compiler, torch.__version__,
                                                   str(Path(torch.__file__).parent), sysconfig.get_path("include")))]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def _source_copy(build_dir: Path, source: bytes) -> Path:
    """The build directory's copy of ``one_pass.cpp``, written if missing or wrong (Note: [One build
    per source], rules 1 and 3)."""
    copy = build_dir / SOURCE.name
    if copy.exists() and copy.read_bytes() == source:
        return copy
    build_dir.mkdir(parents=True, exist_ok=True)
    partial = build_dir / f"{SOURCE.name}.{os.getpid()}.{threading.get_ident()}"
    partial.write_bytes(source)
    os.replace(partial, copy)
    return copy


def _found(compiler: str) -> bool:
    """Whether the compiler PyTorch's builder runs is there (``CXX`` may start with a launcher:
    ``ccache g++``)."""
    return any(shutil.which(word) for word in {compiler, *compiler.split()[:1]})


@contextlib.contextmanager
def _builders_lock(build_dir: Path) -> Iterator[bool]:
    """Held by one process at a time while it builds or loads the kernel: an advisory
    ``fcntl.flock`` of a file of our own, which the kernel releases when its holder dies. Yields
    whether it is held (``False`` where ``fcntl`` is missing)."""
    if fcntl is None:
        yield False
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / "offload.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _clear_left_lock(build_dir: Path, exclusive: bool) -> None:
    """Remove the ``lock`` file PyTorch's extension loader leaves behind when its process dies
    mid-build; a later load would otherwise wait on it forever. Holding :func:`_builders_lock`, no
    other process is building, so any such file was left behind; without it, only one older than
    :data:`STALE_LOCK_SECONDS` is taken as left behind."""
    lock = build_dir / "lock"
    try:
        if exclusive or time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
    except FileNotFoundError:
        pass
