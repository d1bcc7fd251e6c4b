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
