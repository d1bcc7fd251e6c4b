"""Host workers (``offload/streams/workers.py``): in submission order, or by key among the ready."""

from __future__ import annotations

import functools
import threading

import torch

from offload.streams import HostWorker


def test_a_worker_by_key_runs_the_ready_work_with_the_lowest_key_first_and_each_event_is_its_own():
    worker = HostWorker("test worker", by_key=True)
    started, release, landed = threading.Event(), threading.Event(), threading.Event()
    ran: list[int] = []

    def hold() -> None:
        started.set()
        assert release.wait(10)

    worker.submit(hold, key=9)
    assert started.wait(10)
    events = {key: worker.submit(functools.partial(ran.append, key), key=key) for key in (3, 1, 2)}
    # Lowest of all, but what it waits for has not landed: the ready ones go first.
    events[0] = worker.submit(functools.partial(ran.append, 0), key=0, ready=landed.is_set)
    release.set()
    events[3].synchronize()
    assert ran[:3] == [1, 2, 3]
    landed.set()
    events[0].synchronize()
    assert ran == [1, 2, 3, 0] and worker.record().query()
    worker.close(timeout=10)


def test_each_event_of_a_worker_by_key_says_only_that_its_own_work_ran():
    worker = HostWorker("test worker", by_key=True)
    release, landed = threading.Event(), threading.Event()
    worker.submit(lambda: release.wait(10), key=9)
    waiting = worker.submit(lambda: landed.wait(10), key=5, ready=landed.is_set)
    ready = worker.submit(lambda: None, key=6)
    release.set()
    ready.synchronize()  # it ran before the work submitted before it, which still waits
    assert not waiting.query() and not worker.record().query()
    landed.set()
    waiting.synchronize()
    assert worker.record().query()
    worker.close(timeout=10)


def test_a_worker_in_submission_order_ignores_keys():
    worker = HostWorker("test worker")
    ran: list[int] = []
    for key in (3, 1, 2):
        worker.submit(functools.partial(ran.append, key), key=key)
    worker.record().synchronize()
    assert ran == [3, 1, 2]
    worker.close(timeout=10)


def test_a_workers_thread_count_holds_whatever_count_another_thread_sets_later():
    # PyTorch sets a thread's count at its first use to the last count any thread stored: a
    # worker that only called torch.set_num_threads would take the other thread's.
    worker = HostWorker("test worker", num_threads=3)
    seen: list[int] = []

    def other_thread_sets_one_then_read() -> None:
        other = threading.Thread(target=torch.set_num_threads, args=(1,))
        other.start()
        other.join()
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    try:
        worker.submit(other_thread_sets_one_then_read).synchronize()
    finally:
        torch.set_num_threads(before)
    worker.close(timeout=10)
    assert seen == [3]


LONG_WORK_AT_EXIT = """
import pathlib, sys, time
import torch
from offload.streams import HostWorker, workers

workers.EXIT_NOTE_SECONDS = 0.2
worker = HostWorker("offload test work")
done = pathlib.Path(sys.argv[1])

def long_work():
    time.sleep(1.0)  # longer than the quiet wait: the exit says what it waits for
    torch.ones(1000).mul_(2.0)  # in PyTorch's kernels as the interpreter would tear down
    done.write_text("done")

worker.submit(long_work)
print("exiting", flush=True)
"""


def test_the_interpreters_exit_finishes_queued_host_work_and_says_so(tmp_path):
    # Work left to a daemon thread at exit was waited for 10 s at most, then stopped mid-kernel by
    # the interpreter's teardown (the process aborted, the work half done); it is finished now, and
    # past a few seconds a line says what the exit waits for.
    import subprocess
    import sys

    marker = tmp_path / "done"
    finished = subprocess.run([sys.executable, "-c", LONG_WORK_AT_EXIT, str(marker)], capture_output=True, text=True,
                              timeout=120)
    assert (finished.returncode, finished.stdout) == (0, "exiting\n"), finished.stderr[-2000:]
    assert marker.read_text() == "done"
    assert "offload: finishing 1 queued piece(s) of host work (offload test work)" in finished.stderr
