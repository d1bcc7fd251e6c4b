"""Compiles ``one_pass.cpp`` for this machine, once, in the background, and checks it against
PyTorch's fused kernel before anything uses it.

The build takes tens of seconds (PyTorch's headers are large), so it runs on a thread of its own
from the first update that could use it; until it is ready, and for good when it cannot be built
or its check fails, :func:`host_kernel` returns ``None`` and the update runs PyTorch's kernel and
a separate cast, which gives the same bits. The compiled module is cached across processes in
PyTorch's extension directory (``TORCH_EXTENSIONS_DIR``), under a name that changes with the
source, the flags and the PyTorch version. ``OFFLOAD_HOST_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import sys
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
        note = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        _state["note"] = note
        warnings.warn(f"offload: the one-pass host update is off on this machine ({note}); updates run PyTorch's "
                      "fused kernel and a separate cast, with the same results", HostKernelUnavailable, stacklevel=1)
        return
    _state["module"] = module


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
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()[:12]
    name = f"offload_one_pass_{digest}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    with _builders_lock(build_dir) as exclusive:
        _clear_left_lock(build_dir, exclusive)
        return cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                  verbose=False)


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
