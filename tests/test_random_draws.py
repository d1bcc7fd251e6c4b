"""Random numbers drawn where a plain model draws them, for two owners of a generator:

- a layer that keeps a generator of its own as an attribute (``random.Random``, NumPy's
  ``Generator``, bit generator and ``RandomState``, ``torch.Generator``): the recompute draws what
  its forward drew, and the generator continues where the forward left it (rule 6 of Note:
  [Attribute state] in ``offload/walk/module_state.py``);
- an optimizer whose update draws from PyTorch's default generator (SGLD's noise, stochastic
  rounding): its draws come in ``step()``, in the caller's sequence, as the plain optimizer's do
  (Note: [An optimizer that draws random numbers] in ``offload/optimizing/random_draws.py``).

References are the plain layers, run the way OffloadModel runs them (microbatch by microbatch),
and the plain optimizer; everything is compared bit for bit.
"""

from __future__ import annotations

import copy
import random
import threading
import warnings
from collections.abc import Callable

import numpy
import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

from .helpers import ACTIVATIONS, assert_same_grads, microbatched_reference

EXACT = {"rtol": 0.0, "atol": 0.0}

# -- a layer's own generator ----------------------------------------------------------------------

#: Each kind of generator a layer may keep, and how the layer draws one number from it.
GENERATORS = {
    "torch.Generator": (lambda: torch.Generator().manual_seed(7),
                        lambda g: float(torch.rand((), generator=g))),
    "random.Random": (lambda: random.Random(7), lambda g: g.random()),
    "numpy default_rng": (lambda: numpy.random.default_rng(7), lambda g: float(g.random())),
    # A state of arrays (MT19937's key), which plain == cannot compare.
    "numpy Generator(MT19937)": (lambda: numpy.random.Generator(numpy.random.MT19937(7)),
                                 lambda g: float(g.standard_normal())),
    "numpy bit generator": (lambda: numpy.random.PCG64(7), lambda g: float(g.random_raw()) / 2.0**64),
    # One Gaussian a run: every other one is the cached second of a pair.
    "numpy RandomState": (lambda: numpy.random.RandomState(7), lambda g: float(g.standard_normal())),
}


class OwnGenerator(nn.Module):
    """Scales its layer by a number drawn from a generator of its own (a random layer scale)."""

    def __init__(self, kind: str, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        make, self.draw = GENERATORS[kind]
        self.generator = make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x) * (1.0 + self.draw(self.generator))


def generator_state(module: OwnGenerator) -> object:
    g = module.generator
    if isinstance(g, torch.Generator):
        return g.get_state().tolist()
    if isinstance(g, random.Random):
        return g.getstate()
    state = g.get_state(legacy=False) if isinstance(g, numpy.random.RandomState) else getattr(g, "bit_generator", g).state
    return repr(state)  # arrays, printed in full for MT19937's key


MODES = {**{name: ACTIVATIONS[name] for name in ("recompute", "kept", "offload_last")},
         "resident": {"resident_slices": 2}}


@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(GENERATORS))
def test_a_layers_own_generator_is_replayed(kind, mode, num_microbatches):
    torch.manual_seed(0)
    layers = nn.Sequential(*[OwnGenerator(kind) for _ in range(4)], nn.Linear(6, 6))
    reference = copy.deepcopy(layers)
    model = OffloadModel(layers, device="cpu", num_slices=3, num_microbatches=num_microbatches, **MODES[mode])
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        want = microbatched_reference(reference, model.partition, x, num_microbatches)
        got = model(x)
        torch.testing.assert_close(got, want, **EXACT)  # step 1 on: the generators were left where plainly
        (want * torch.arange(6.0)).sum().backward()
        (got * torch.arange(6.0)).sum().backward()
        assert_same_grads(layers, reference, **EXACT)
        for mine, theirs in zip(layers[:4], reference[:4]):
            assert generator_state(mine) == generator_state(theirs)
        layers.zero_grad()
        reference.zero_grad()


def test_a_system_random_is_left_as_a_plain_value():
    """``random.SystemRandom`` has no state to replay (the plain model's draws cannot be repeated
    either): taken for a plain value, not refused."""
    from offload.walk.module_state import AttributeSnapshot

    module = nn.Linear(2, 2)
    module.generator = random.SystemRandom()
    snapshot = AttributeSnapshot([module])
    module.generator.random()
    assert not snapshot.changed_since()


# -- an optimizer that draws ----------------------------------------------------------------------


class NoisySGD(torch.optim.Optimizer):
    """SGD with Gaussian noise added to each parameter, drawn from PyTorch's default generator."""

    def __init__(self, params, lr: float = 0.05, noise: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "noise": noise})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"]).add_(torch.randn_like(p), alpha=group["noise"])


def dropout_stack(width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.3))],
                         nn.Linear(width, 1))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, width: int = 16, dtype=torch.float32,
          after_step: Callable[[int], None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's loss and the default generator's state after it: the data is drawn from that
    generator after each step(), where an overlapped noisy update would race with it."""
    torch.manual_seed(1)
    seen = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(8, width, dtype=dtype)).float().square().mean()
        loss.backward()
        optimizer.step()
        seen.append((loss.detach(), torch.get_rng_state()))
        if after_step is not None:
            after_step(step)
    return seen


def assert_same_training(plain_run, run, plain: nn.Module, model: nn.Module) -> None:
    for step, ((want, want_rng), (got, got_rng)) in enumerate(zip(plain_run, run)):
        torch.testing.assert_close(got, want, **EXACT, msg=f"loss of step {step}")
        assert torch.equal(got_rng, want_rng), f"the default generator after step {step}"
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **EXACT)


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["in step", "update_in_backward"])
def test_an_optimizer_that_draws_steps_as_plain(update_in_backward):
    plain = dropout_stack()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4)
    optimizer = OffloadOptimizer(model, NoisySGD, update_in_backward=update_in_backward)
    plain_run = train(plain, NoisySGD(plain.parameters()), steps=4)
    with pytest.warns(UserWarning, match=r"NoisySGD's update draws random numbers .* inside step\(\)") as caught:
        run = train(model, optimizer, steps=4)
    assert sum("draws random numbers" in str(w.message) for w in caught) == 1  # once
    assert_same_training(plain_run, run, plain, model)
    assert optimizer._in_backward is None  # its updates wait for step(), after backward's draws
    assert optimizer._updates.backlog() == 0  # step() returned with its updates done


@pytest.mark.parametrize("outside_first", [False, True], ids=["head last", "head first"])
def test_parameters_outside_the_model_draw_in_the_plain_order(outside_first):
    """A head applied after the model, stepped by the same optimizer: its update draws before or
    after the slices' as the plain optimizer's groups list it."""
    plain = dropout_stack()
    plain_head = nn.Linear(1, 1)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4)
    head = copy.deepcopy(plain_head)

    def ordered(body: nn.Module, top: nn.Module) -> list[nn.Parameter]:
        return [*top.parameters(), *body.parameters()] if outside_first else [*body.parameters(), *top.parameters()]

    optimizer = OffloadOptimizer(model, NoisySGD, ordered(model, head))
    plain_run = train(nn.Sequential(plain, plain_head), NoisySGD(ordered(plain, plain_head)), steps=3)
    with pytest.warns(UserWarning, match="draws random numbers"):
        run = train(nn.Sequential(model, head), optimizer, steps=3)
    assert_same_training(plain_run, run, plain, model)
    torch.testing.assert_close(head.weight.detach(), plain_head.weight.detach(), **EXACT)


def test_groups_that_interleave_the_slices_are_said_to_differ():
    """Weight decay groups over every layer: the slices' updates cannot draw in the plain order."""
    model = OffloadModel(dropout_stack(), device="cpu", num_slices=4)
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    optimizer = OffloadOptimizer(model, NoisySGD, [{"params": weights}, {"params": biases, "noise": 0.0}])
    with pytest.warns(UserWarning, match="another order than the plain optimizer"):
        train(model, optimizer, steps=1)


class HeldSGD(torch.optim.SGD):
    """SGD whose update waits, once armed, until the test lets it go."""

    gate: threading.Event | None = None

    def step(self, closure=None):
        if HeldSGD.gate is not None:
            assert HeldSGD.gate.wait(10), "the test never let the update go"
        return super().step(closure)


def test_an_optimizer_that_does_not_draw_is_overlapped_after_its_first_step():
    plain = dropout_stack()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4)
    optimizer = OffloadOptimizer(model, HeldSGD, lr=0.05)
    gate = threading.Event()

    def held_from_the_second_step(step: int) -> None:
        if step == 0:
            assert optimizer._draws.draws is False
            HeldSGD.gate = gate
        else:
            assert optimizer._updates.backlog() > 0  # step() returned with the updates held
            gate.set()

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = train(model, optimizer, steps=2, after_step=held_from_the_second_step)
        optimizer.synchronize()
        assert not [w for w in caught if "random numbers" in str(w.message)]
    finally:
        HeldSGD.gate = None
        gate.set()
    plain_run = train(plain, torch.optim.SGD(plain.parameters(), lr=0.05), steps=2)
    assert_same_training(plain_run, run, plain, model)
    # PyTorch's own classes draw nothing: overlapped from the first step.
    assert OffloadOptimizer(model, torch.optim.SGD, lr=0.05)._draws.draws is False


def test_torchao_stochastic_rounding_steps_as_plain():
    """torchao's AdamW8bit with ``bf16_stochastic_round`` rounds each bfloat16 parameter with
    random bits from the default generator, inside its compiled step."""
    torchao_optim = pytest.importorskip("torchao.optim", reason="the lowbit extra (torchao) is not installed")
    width = 64  # one shape for every weight: each new one compiles the class's step once
    # Without the stack's last layer (width to 1): its weight and bias would be two more shapes.
    # Left are the weights, whose state is quantised, and the biases, whose state is plain.
    plain = dropout_stack(width)[:-1].to(torch.bfloat16)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=4)
    kwargs = {"lr": 1e-2, "bf16_stochastic_round": True, "block_size": 256}
    optimizer = OffloadOptimizer(model, torchao_optim.AdamW8bit, **kwargs)
    plain_run = train(plain, torchao_optim.AdamW8bit(plain.parameters(), **kwargs), 3, width, torch.bfloat16)
    with pytest.warns(UserWarning, match="draws random numbers"):
        run = train(model, optimizer, 3, width, torch.bfloat16)
    assert_same_training(plain_run, run, plain, model)
