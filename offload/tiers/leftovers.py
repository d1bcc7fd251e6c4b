"""Tier directories left behind: a process killed with ``SIGKILL`` (the OOM killer, a job
scheduler's hard limit) cannot remove its ``offload-state-*`` directory, and a run that is restarted
again and again fills the disk with them. Each directory names the process that made it
(``owner.json``), so that the next tier made in the same place can tell which ones no process uses
any more (``state_files.py`` says so: in a warning when a tier is made, and in the error when the
disk is full). Nothing is deleted: the directory may be on a disk that other machines share, and
what to delete is the user's call."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

OWNER = "owner.json"


def mark_owner(directory: Path) -> None:
    """Write which process made ``directory`` (this one), for :func:`left_behind` to read later."""
    (directory / OWNER).write_text(json.dumps(_this_process()))


def left_behind(root: Path) -> list[tuple[Path, int]]:
    """The tier directories in ``root`` whose process no longer runs on this machine, with the
    bytes their files take on disk. Directories made by another machine, or by a process that still
    runs, or that were kept on purpose (``keep=True`` writes a manifest when it closes) are not
    among them; nor is one without an owner's record (it is not known whose it is)."""
    found = []
    try:
        entries = sorted(root.glob("offload-state-*"))
    except OSError:
        return []
    for directory in entries:
        try:
            if (directory / "manifest.json").exists():
                continue
            owner = json.loads((directory / OWNER).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(owner, dict) or _runs(owner):
            continue
        found.append((directory, _disk_bytes(directory)))
    return found


def _this_process() -> dict[str, object]:
    return {"host": socket.gethostname(), "boot": _boot_id(), "pids": _pid_namespace(), "pid": os.getpid(),
            "started": _started(os.getpid())}


def _runs(owner: dict[str, object]) -> bool:
    """Whether the process ``owner`` names may still run. Unknown counts as running: another
    machine's process, or a record this machine cannot check."""
    if owner.get("host") != socket.gethostname() or owner.get("pids") != _pid_namespace():
        return True  # another machine, or another container's processes (which this one cannot see)
    boot = _boot_id()
    if boot is not None and owner.get("boot") is not None and owner.get("boot") != boot:
        return False  # the machine restarted since: no process of then runs now
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    started = _started(pid)
    if started is not None:
        return started == owner.get("started")  # another process that was given the same pid is not it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it runs, under another user
    return owner.get("started") is None  # a pid with no start time now, but one then: not the same


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux), or ``None`` where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name in parentheses may hold spaces
    except (IndexError, ValueError):
        return None


def _disk_bytes(directory: Path) -> int:
    """Bytes the files in ``directory`` take on disk (preallocated: their blocks, not their length)."""
    total = 0
    try:
        for entry in directory.iterdir():
            total += entry.stat().st_blocks * 512
    except (OSError, AttributeError):  # removed meanwhile; no st_blocks on Windows
        pass
    return total
