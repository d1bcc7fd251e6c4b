"""Shared test helpers: the reference to compare against, and the devices to run on.

Every parity test builds an unwrapped reference with ``copy.deepcopy`` and runs it from the same
generator state; GPU variants run the same test on ``cuda`` behind the ``cuda`` marker.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadActivations

CUDA = pytest.mark.cuda

#: Run a test on the CPU always and on CUDA behind the marker.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA)]

#: The ways a slice keeps its activations for backward, as OffloadModel keyword arguments (Note:
#: [Three ways to keep a slice's activations] in offload/walk/activation_policy.py). The offloaded
#: ones copy every saved tensor (``min_bytes=0``), so that the tests' small models take the path.
ACTIVATIONS: dict[str, dict[str, Any]] = {
    "recompute": {"checkpoint_activation": True},
    "kept": {"checkpoint_activation": False},
    # The last two slices offloaded, the ones before recomputed.
    "offload_last": {"checkpoint_activation": True,
                     "offload_activations": OffloadActivations(last=2, min_bytes=0)},
    # Every slice offloaded (``last`` is clamped to the number of slices).
    "offload_all": {"checkpoint_activation": False,
                    "offload_activations": OffloadActivations(last=1_000, min_bytes=0)},
}


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: (p.grad.detach().clone() if p.grad is not None else None) for name, p in module.named_parameters()}


def assert_same_grads(actual: nn.Module, expected: nn.Module, **tolerance: Any) -> None:
    got, want = grads_of(actual), grads_of(expected)
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{name}: expected no gradient"
            continue
        assert got[name] is not None, f"{name}: missing gradient"
        torch.testing.assert_close(got[name].to(want[name].device), want[name], msg=lambda m: f"{name}: {m}",
                                   **tolerance)


def clip_where_placed(plain_params: Sequence[nn.Parameter], placed: Sequence[nn.Parameter],
                      max_norm: float) -> torch.Tensor:
    """PyTorch's clip of ``plain_params``' gradients, the total norm taken where ``placed`` (the
    offloaded twin's parameters) keeps each gradient: the reference for ``offload.clip_grad_norm_``,
    which is PyTorch's clip of the tensors it is given. On a GPU the plain model's own norm reduces
    on the device, in another order than the host's (its last bits can differ: 2e-7 relative on an
    H200); the coefficient and the scaling are then the same operations as PyTorch's."""
    grads = [p.grad.to(q.grad.device) for p, q in zip(plain_params, placed, strict=True)]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    torch.nn.utils.clip_grads_with_norm_(list(plain_params), max_norm, norm)
    return norm


class SteppedWherePlaced:
    """A plain model's PyTorch optimizer stepping copies of its parameters kept where an offloaded
    twin keeps each (the host for streamed slices, the device for resident ones), written back after
    each step: the reference for ``OffloadOptimizer`` on a GPU. An optimizer's CPU and CUDA kernels
    round differently, so the plain model stepping on the device is not the host update's reference."""

    def __init__(self, params: Sequence[nn.Parameter], placed: Sequence[nn.Parameter],
                 optimizer_class: type[torch.optim.Optimizer], **options: Any) -> None:
        self.params = list(params)
        self.copies = [nn.Parameter(p.detach().to(q.device, copy=True)) for p, q in zip(self.params, placed, strict=True)]
        self.optimizer = optimizer_class(self.copies, **options)
        self.param_groups = [{"params": self.params}]  # the plain model's, for the tests' clips

    def step(self) -> None:
        for p, copy_ in zip(self.params, self.copies):
            copy_.grad = None if p.grad is None else p.grad.to(copy_.device, copy=True)
        self.optimizer.step()
        with torch.no_grad():
            for p, copy_ in zip(self.params, self.copies):
                p.copy_(copy_)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None and set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.optimizer.zero_grad(set_to_none=set_to_none)


def microbatched_reference(layers: nn.Sequential, partition: Sequence[Sequence[str]], x: torch.Tensor,
                           num_microbatches: int) -> torch.Tensor:
    """What OffloadModel computes with microbatches: each slice runs its layers on each chunk in turn.

    Built from the plain layers only: slice by slice, chunk by chunk, in the documented order, so
    random layers draw the same numbers as the offloaded model's.
    """
    chunks = list(torch.tensor_split(x, min(num_microbatches, x.shape[0]), dim=0))
    for names in partition:
        chunks = [_run(layers, names, chunk) for chunk in chunks]
    return torch.cat(chunks, dim=0)


def _run(layers: nn.Sequential, names: Sequence[str], value: Any) -> Any:
    for name in names:
        value = layers._modules[name](value)
    return value


def seeded(seed: int, fn: Callable[[], Any]) -> Any:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return fn()


class HostStepped:
    """A plain ``torch.optim`` optimizer stepping host copies of a device model's parameters.

    OffloadModel's parameters live on the host, so the user's optimizer runs the host kernels; the
    same optimizer over CUDA parameters runs other kernels whose rounding differs in the last bit
    (measured on an H100: 4.5e-8 after four AdamW steps). This reference runs the plain model on
    its device and the plain optimizer on the host, which is what OffloadModel must equal bit for
    bit. Each step reads the model's current values first, so writes to the parameters between
    steps (``p.data.clamp_``) are honoured.
    """

    def __init__(self, model: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        self.params = list(model.parameters())
        self.masters = [nn.Parameter(p.detach().cpu().clone()) for p in self.params]
        self.optimizer = make_optimizer(self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for master, p in zip(self.masters, self.params):
            master.copy_(p)
            master.grad = None if p.grad is None else p.grad.cpu()
        self.optimizer.step()
        for master, p in zip(self.masters, self.params):
            p.copy_(master)


def count_parallel_norms(monkeypatch: Any) -> list[int]:
    """A list that grows by one at each total norm ``offload.clip_grad_norm_`` computes."""
    import offload.clipping

    calls: list[int] = []
    norm = offload.clipping.total_grad_norm
    monkeypatch.setattr(offload.clipping, "total_grad_norm", lambda *a, **k: calls.append(1) or norm(*a, **k))
    return calls


def run_state_lookups(monkeypatch: Any) -> list[torch.Tensor]:
    """A list that grows by each tensor binding asks for an 8-bit layer's run state (Note:
    [Quantized weights], rule 6, in ``offload/streams/quantized.py``)."""
    from offload.streams import quantized

    looked_up: list[torch.Tensor] = []

    def looking_up(obj: Any, name: str, *default: Any) -> Any:
        if name == quantized.RUN_STATE:
            looked_up.append(obj)
        return getattr(obj, name, *default)

    # The module's own name shadows the builtin, for quantized.py's code alone.
    monkeypatch.setattr(quantized, "getattr", looking_up, raising=False)
    return looked_up


def cli_result(main: Callable[[list[str]], Any], argv: Sequence[str], capsys: Any) -> tuple[int, str, str]:
    """Run a command's ``main`` on ``argv``: its exit code (0 when it returns; a message given to
    ``SystemExit`` is printed to stderr, code 1) and what it printed, out and err."""
    code = 0
    try:
        main(list(argv))
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 1
        if not isinstance(exit_info.code, int):
            print(exit_info.code, file=sys.stderr)
    out = capsys.readouterr()
    return code, out.out, out.err


def join_or_kill(ranks: Any, seconds: float, what: str) -> None:
    """Wait for the processes of ``torch.multiprocessing.start_processes(..., join=False)``; past
    ``seconds`` kill those still running and fail the test, naming ``what``."""
    deadline = time.monotonic() + seconds
    while not ranks.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                if process.is_alive():
                    process.kill()
                process.join()
            pytest.fail(f"{what} still running after {seconds} s; killed")


def killed_by_itself(target: Callable[..., Any], args: tuple[Any, ...], seconds: float) -> bool:
    """Run ``target(*args)`` in a forkserver process that is expected to SIGKILL itself (a kill at a
    chosen moment); whether it did, once it ended or was killed after ``seconds``."""
    import signal

    import torch.multiprocessing as mp

    child = mp.get_context("forkserver").Process(target=target, args=args)
    child.start()
    child.join(seconds)
    if child.is_alive():
        child.kill()
        child.join()
        return False
    return child.exitcode == -signal.SIGKILL


@pytest.fixture(autouse=True)
def quiet_transformers() -> Any:
    """Transformers' logging at errors only while a test runs (autouse where a test module imports
    it): its warnings of a tiny random model's configuration are noise there."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


class Scale(nn.Module):
    """A learnable scalar: a 0-d parameter, whose optimizer moments are 0-d too."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def trained(model: Any, make_input: Callable[[], torch.Tensor], steps: int = 2,
            optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, **options: Any) -> Any:
    """An ``OffloadOptimizer`` after ``steps`` steps with ``.grad`` kept (the gradient pool's steady
    state), synchronized, returned open for a footprint to count its state while it lives."""
    from offload import OffloadOptimizer

    optimizer = OffloadOptimizer(model, optimizer_class, lr=1e-3, **options)
    for _ in range(steps):
        model(make_input()).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    return optimizer


def footprint_after_steps(model: Any, make_input: Callable[[], torch.Tensor], steps: int = 2, **options: Any) -> Any:
    """``model.memory_footprint()`` after :func:`trained`, the optimizer closed afterwards."""
    optimizer = trained(model, make_input, steps, **options)
    footprint = model.memory_footprint()
    optimizer.close()
    return footprint
