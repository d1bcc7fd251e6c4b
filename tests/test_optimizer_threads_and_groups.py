"""OffloadOptimizer's updates run one at a time, on its update worker, parameters outside the model
included (Note: [Parameters outside the model] in ``offload/optimizing/stepping.py``); and a group
added after construction is made as the class's own ``add_param_group()`` makes it (torchao's
low-bit AdamW turns its ``lr`` into a tensor: ``as_class_adds`` in ``offload/optimizing/plan.py``).

The first matters for classes whose host kernels are not safe on two threads at once: bitsandbytes'
8-bit classes gave wrong parameters in a few runs out of a hundred when the parameters outside the
model were stepped in the caller's thread beside the worker's slices. A class that notes where and
when each of its steps runs shows it on every run.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from offload import HostUpdateError, OffloadModel, OffloadOptimizer

EXACT = {"rtol": 0, "atol": 0}
NUM_SLICES = 3
HEAD_SHAPE = (3, 7)  # no parameter of the network has it: a step over it is the head's


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def head() -> nn.Parameter:
    """A parameter applied after the model: outside it."""
    return nn.Parameter(torch.randn(HEAD_SHAPE, generator=torch.Generator().manual_seed(1)))


def loss_of(model: nn.Module, weight: torch.Tensor, step: int) -> torch.Tensor:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
    return (model(x) @ weight).pow(2).mean()


class Watched(torch.optim.SGD):
    """SGD whose steps note the thread each runs on, and each step that starts while another is
    running. Each waits a moment for the other kind (the head's, a slice's) to start, so two that
    may run at once do, on every run."""

    lock = threading.Lock()
    running = 0
    overlapped: list[str] = []
    threads: dict[str, set[str]] = {}
    started = {"head": threading.Event(), "slice": threading.Event()}
    fail_on_head = False

    @classmethod
    def reset(cls) -> None:
        cls.overlapped, cls.threads, cls.fail_on_head = [], {}, False
        cls.new_step()

    @classmethod
    def new_step(cls) -> None:
        for event in cls.started.values():
            event.clear()

    @torch.no_grad()
    def step(self, closure=None):
        is_head = any(p.shape == HEAD_SHAPE for group in self.param_groups for p in group["params"])
        kind, other = ("head", "slice") if is_head else ("slice", "head")
        with Watched.lock:
            Watched.running += 1
            if Watched.running > 1:
                Watched.overlapped.append(kind)
            Watched.threads.setdefault(kind, set()).add(threading.current_thread().name)
        Watched.started[kind].set()
        try:
            Watched.started[other].wait(0.3)  # long enough for the other, if it may run now, to start
            if is_head and Watched.fail_on_head:
                raise ValueError("the head's step fails")
            return super().step(closure)
        finally:
            with Watched.lock:
                Watched.running -= 1


@pytest.fixture
def watched():
    Watched.reset()
    yield Watched
    Watched.reset()


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "update_in_backward"])
def test_the_update_of_parameters_outside_the_model_never_runs_beside_a_slice_update(watched, in_backward):
    """``step()`` used to step the head in the caller's thread while the worker updated the slices
    it had just handed over (or those backward started): two optimizer steps at once. Now the
    head's runs on the worker too, before the slices', and ``step()`` returns once it is done."""
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    plain_head, offload_head = head(), head()
    kwargs = {"lr": 0.1, "momentum": 0.9, "fused": True}
    plain_opt = torch.optim.SGD([*plain.parameters(), plain_head], **kwargs)
    optimizer = OffloadOptimizer(model, Watched, [*model.parameters(), offload_head], update_in_backward=in_backward,
                                 **kwargs)
    for step in range(3):
        watched.new_step()
        for m, w, opt in ((plain, plain_head, plain_opt), (model, offload_head, optimizer)):
            loss_of(m, w, step).backward()
            opt.step()
            opt.zero_grad()
        # Updated when step() returns, with no wait: the caller reads it next, as after a plain step().
        torch.testing.assert_close(offload_head, plain_head, **EXACT)
    optimizer.synchronize()
    assert watched.overlapped == []
    assert watched.threads["head"] == watched.threads["slice"] == {"offload host update"}
    for (name, want), got in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, **EXACT, msg=name)
    torch.testing.assert_close(optimizer.state_dict(), plain_opt.state_dict(), **EXACT)


def test_a_failed_update_of_parameters_outside_the_model_is_raised_by_step_and_skips_the_slices(watched):
    """Handed over before slice 0, the head's update is the first of the step: its error comes from
    ``step()``, as it did from the caller's thread, the slices queued behind it are skipped (the
    worker skips what follows a failure), and the saves refuse the mix until a load."""
    model = OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    weight = head()
    optimizer = OffloadOptimizer(model, Watched, [*model.parameters(), weight], lr=0.1, fused=True)
    loss_of(model, weight, 0).backward()
    optimizer.step()
    before = [p.detach().clone() for p in (*model.parameters(), weight)]
    watched.new_step()
    watched.fail_on_head = True
    optimizer.zero_grad()
    loss_of(model, weight, 1).backward()
    with pytest.raises(HostUpdateError, match=r"while updating the parameters outside the model .* so the slices' "
                                               r"updates of this step were skipped") as raised:
        optimizer.step()
    assert isinstance(raised.value.__cause__, ValueError)
    optimizer.synchronize()
    for want, got in zip(before, (*model.parameters(), weight)):
        torch.testing.assert_close(got, want, **EXACT)
    with pytest.raises(RuntimeError, match=r"the parameters outside the model raised in its update and may be partly "
                                           r"updated, slice\(s\) 0, 1, 2 left as they were"):
        optimizer.state_dict()


def test_bnb_8bit_classes_with_parameters_outside_the_model_match_the_plain_class():
    """The case that showed it: bitsandbytes' CPU kernels on two threads at once gave wrong
    parameters now and then (Note: [Parameters outside the model])."""
    bnb = pytest.importorskip("bitsandbytes", reason="the bnb extra (bitsandbytes) is not installed")
    size = 256  # over min_8bit_size: 8-bit moments

    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(size, size, bias=False), nn.Tanh(), nn.Linear(size, size, bias=False),
                             nn.Tanh(), nn.Linear(size, size, bias=False))

    def train(cls: type[torch.optim.Optimizer], offloaded: bool) -> list[torch.Tensor]:
        net, w = layers(), nn.Parameter(torch.randn(size, size, generator=torch.Generator().manual_seed(1)) / 16)
        if offloaded:
            net = OffloadModel(net, device="cpu", num_slices=NUM_SLICES)
            opt = OffloadOptimizer(net, cls, [*net.parameters(), w], lr=1e-3)
        else:
            opt = cls([*net.parameters(), w], lr=1e-3)
        generator = torch.Generator().manual_seed(0)
        for _ in range(4):
            opt.zero_grad()
            (net(torch.randn(8, size, generator=generator)) @ w).square().mean().backward()
            opt.step()
        if offloaded:
            opt.synchronize()
        return [p.detach().clone() for p in (*net.parameters(), w)]

    for cls in (bnb.optim.Adam8bit, bnb.optim.AdamW8bit):
        want = train(cls, offloaded=False)
        for _ in range(5):
            for expected, got in zip(want, train(cls, offloaded=True)):
                torch.testing.assert_close(got, expected, **EXACT)


def test_a_group_added_after_some_steps_is_made_by_the_class_torchao():
    """torchao's AdamW classes make each group's ``lr`` a tensor in their ``add_param_group()``, and
    their step refuses a number. OffloadOptimizer added the group as ``torch.optim`` does: the first
    step over it failed on the worker (a HostUpdateError, after slice 0 was updated)."""
    ao = pytest.importorskip("torchao.optim", reason="the lowbit extra (torchao) is not installed")
    plain, model = network(), OffloadModel(network(), device="cpu", num_slices=NUM_SLICES)
    plain_opt = ao._AdamW(list(plain.parameters())[:2], lr=1e-2)
    optimizer = OffloadOptimizer(model, ao._AdamW, list(model.parameters())[:2], lr=1e-2)
    weight = {"plain": head().detach(), "offload": head().detach()}
    runs = (("plain", plain, plain_opt), ("offload", model, optimizer))
    for step in range(4):
        if step == 2:
            for name, m, opt in runs:
                # An iterator, read once; and an empty group, which the class cannot be built over.
                opt.add_param_group({"params": iter(list(m.parameters())[2:]), "lr": 5e-3})
                opt.add_param_group({"params": [], "lr": 1e-3})
        for name, m, opt in runs:
            opt.zero_grad()
            loss_of(m, weight[name], step).backward()
            opt.step()
    optimizer.synchronize()
    for got, want in zip(optimizer.param_groups, plain_opt.param_groups):
        assert type(got["lr"]) is type(want["lr"]) is torch.Tensor
    for (name, want), got in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, **EXACT, msg=name)
    torch.testing.assert_close(optimizer.state_dict(), plain_opt.state_dict(), **EXACT)


@pytest.mark.parametrize("num_threads", [1, 3])
def test_threads_started_after_an_update_keep_the_thread_count_they_had(num_threads):
    # The worker's torch.set_num_threads also stored its count for every thread started later: a
    # user's training thread ran on one core (or another count), and its reductions' rounding moved.
    def count_in_a_new_thread() -> int:
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join(timeout=30)
        return seen[0]

    before = count_in_a_new_thread()
    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), device="cpu")
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, num_threads=num_threads)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.synchronize()
    assert count_in_a_new_thread() == before
