"""Saved activations offloaded to the host instead of recomputed (Note: [Three ways to keep a slice's
activations] in offload/walk/activation_policy.py, Note: [Offloaded saved tensors] in
offload/streams/saved_activations.py): the policy, what crosses the link, what stays where, and
what each slice runs. Parity with the plain model is tested where the other ways are (test_parity,
test_semantics, test_mixed_precision, test_transformers, test_streamcheck), over every policy."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadActivations, OffloadModel
from offload.model import engine_of
from offload.walk.activation_policy import ActivationMode, ActivationPlan

from .helpers import CUDA, DEVICES, assert_same_grads, clone_model, seeded

EXACT = {"rtol": 0.0, "atol": 0.0}
ROWS, WIDTH = 6, 16


def linear_tanh(depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


# -- the policy -------------------------------------------------------------------------------------


def test_the_policy_names_slices_by_index_or_by_a_rule():
    assert OffloadActivations(last=2).chosen(5) == {3, 4}
    assert OffloadActivations(last=9).chosen(3) == {0, 1, 2}
    assert OffloadActivations(last=0).chosen(3) == frozenset()
    assert OffloadActivations(slices=[0, -1]).chosen(4) == {0, 3}
    plan = ActivationPlan.of(True, OffloadActivations(slices=[1], min_bytes=5), 3)
    assert plan.modes == (ActivationMode.RECOMPUTE, ActivationMode.OFFLOAD, ActivationMode.RECOMPUTE)
    assert plan.min_bytes == 5
    assert ActivationPlan.of(False, None, 2).modes == (ActivationMode.KEEP, ActivationMode.KEEP)


@pytest.mark.parametrize(("kwargs", "error", "fragment"), [
    ({}, ValueError, "exactly one of slices"),
    ({"slices": [0], "last": 1}, ValueError, "exactly one of slices"),
    ({"last": -1}, ValueError, "last must be a non-negative int"),
    ({"last": 1, "min_bytes": -1}, ValueError, "min_bytes must be a non-negative int"),
    ({"slices": "01"}, TypeError, "slices must be a list of slice indices"),
    ({"slices": [0.5]}, TypeError, "slices must hold ints"),
])
def test_a_bad_policy_is_refused_with_what_to_pass(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        OffloadActivations(**kwargs)


def test_the_model_refuses_a_slice_it_does_not_have_and_a_policy_of_another_type():
    with pytest.raises(ValueError, match=r"names slice\(s\) \[3\], but the model has 3 slices"):
        OffloadModel(linear_tanh(), device="cpu", num_slices=3, offload_activations=OffloadActivations(slices=[3]))
    with pytest.raises(TypeError, match="offload_activations must be an offload.OffloadActivations"):
        OffloadModel(linear_tanh(), device="cpu", num_slices=3, offload_activations=[0])  # type: ignore[arg-type]


def test_copies_and_pickles_keep_the_policy():
    policy = OffloadActivations(last=2, min_bytes=0)
    model = OffloadModel(linear_tanh(), device="cpu", num_slices=3, offload_activations=policy)
    assert "offload_activations=OffloadActivations(slices=None, last=2, min_bytes=0)" in repr(model)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.offload_activations == policy
        x = torch.randn(ROWS, WIDTH)
        twin(x).sum().backward()
        assert engine_of(twin).activations.saved_bytes > 0


def test_a_model_pickled_before_the_setting_existed_loads_without_it():
    model = OffloadModel(linear_tanh(), device="cpu", num_slices=3)
    state = model.__getstate__()
    del state["offload_activations"]
    twin = OffloadModel.__new__(OffloadModel)
    twin.__setstate__(state)
    assert twin.offload_activations is None
    twin(torch.randn(ROWS, WIDTH)).sum().backward()


# -- what runs, what moves ---------------------------------------------------------------------------


class Runs:
    """Forward runs per layer, outside the layers: a recompute restores a layer's plain attributes
    (lists and dicts by a shallow copy) as its forward found them."""

    def __init__(self) -> None:
        self.counts: list[int] = []


class Counting(nn.Module):
    """A linear layer that counts its forward runs."""

    def __init__(self, runs: Runs) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.runs = runs
        self.index = len(runs.counts)
        runs.counts.append(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.counts[self.index] += 1
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_an_offloaded_slice_runs_once_and_a_recomputed_one_twice(num_microbatches):
    runs = Runs()
    model = OffloadModel([Counting(runs) for _ in range(4)], device="cpu", num_microbatches=num_microbatches,
                         offload_activations=OffloadActivations(slices=[1, 2], min_bytes=0))
    model(torch.randn(ROWS, WIDTH)).sum().backward()
    # Slice 0 is recomputed; 1 and 2 are offloaded; the last keeps its last microbatch's graph and
    # recomputes the others.
    assert runs.counts == [2 * num_microbatches, num_microbatches, num_microbatches, 2 * num_microbatches - 1]


@pytest.mark.parametrize("num_microbatches", [1, 3])
def test_saved_tensors_are_loaded_one_step_ahead_of_their_backward(monkeypatch, num_microbatches):
    from offload.streams.saved_activations import SavedActivations

    found: list[bool] = []  # per offloaded run, in backward order: were its copies loaded already?
    wait = SavedActivations.wait

    def watching(self: SavedActivations) -> None:
        found.append(all(copy.device is not None for copy in self.host_copies))
        wait(self)

    monkeypatch.setattr(SavedActivations, "wait", watching)
    model = OffloadModel(linear_tanh(4), device="cpu", num_slices=4, num_microbatches=num_microbatches,
                         offload_activations=OffloadActivations(last=4, min_bytes=0))
    model(torch.randn(ROWS, WIDTH)).sum().backward()
    # Every run but the last slice's last microbatch (a kept graph) is offloaded; each was loaded
    # while the run before it in backward was differentiated.
    assert found == [True] * (4 * num_microbatches - 1)


def test_exactly_the_saved_activations_cross_the_link_and_never_a_weight():
    # Slice 0 alone is offloaded, the rest keep their graphs: its Linear saves its input and its
    # Tanh its output, each ROWS x WIDTH float32; its weight is read from the slot again.
    model = OffloadModel(linear_tanh(), device="cpu", num_slices=3, checkpoint_activation=False,
                         offload_activations=OffloadActivations(slices=[0], min_bytes=0))
    activations = engine_of(model).activations
    model(torch.randn(ROWS, WIDTH)).sum().backward()
    assert activations.saved_bytes == activations.offloaded_bytes == 2 * ROWS * WIDTH * 4


def test_saved_tensors_under_the_threshold_stay_on_the_device_with_the_same_results():
    torch.manual_seed(1)
    reference = linear_tanh()
    x = torch.randn(ROWS, WIDTH)
    outcomes = []
    for min_bytes in (0, ROWS * WIDTH * 4 + 1):
        model = OffloadModel(clone_model(reference), device="cpu", num_slices=3, checkpoint_activation=False,
                             offload_activations=OffloadActivations(slices=[0, 1], min_bytes=min_bytes))
        out = model(x)
        out.sum().backward()
        outcomes.append((engine_of(model).activations.saved_bytes, out, [p.grad for p in model.parameters()]))
    (copied, out_copied, grads_copied), (kept, out_kept, grads_kept) = outcomes
    assert copied == 2 * 2 * ROWS * WIDTH * 4 and kept == 0
    torch.testing.assert_close(out_kept, out_copied, **EXACT)
    for a, b in zip(grads_kept, grads_copied):
        torch.testing.assert_close(a, b, **EXACT)


class KeepsWeakrefs(nn.Module):
    """Remembers weakly what it computes: the tensors its graph saves, and its output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.seen: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)  # saved by nothing: tanh saves its output
        out = torch.tanh(hidden)
        self.seen = [weakref.ref(hidden), weakref.ref(out)]
        return out


@pytest.mark.parametrize(("offloaded", "alive"), [(False, True), (True, False)], ids=["kept", "offloaded"])
def test_an_offloaded_slice_leaves_no_activation_behind_until_backward(offloaded, alive):
    first, second = KeepsWeakrefs(), KeepsWeakrefs()
    policy = OffloadActivations(slices=[0, 1], min_bytes=0) if offloaded else None
    model = OffloadModel([first, second, nn.Linear(WIDTH, WIDTH)], device="cpu", checkpoint_activation=False,
                         offload_activations=policy)
    loss = model(torch.randn(ROWS, WIDTH)).sum()
    gc.collect()
    # A kept graph holds its slice's output (tanh saved it) until backward; an offloaded one holds
    # its host copy only, so the device tensors are gone as soon as forward is done with them.
    assert [ref() is not None for ref in first.seen + second.seen] == [False, alive, False, alive]
    loss.backward()


def test_pooled_host_buffers_are_reused_from_step_to_step_and_counted_while_in_use():
    model = OffloadModel(linear_tanh(), device="cpu", num_slices=3,
                         offload_activations=OffloadActivations(last=3, min_bytes=0))
    engine = engine_of(model)
    sizes = []
    for step in range(4):
        loss = model(torch.randn(ROWS, WIDTH)).sum()
        waiting = model.memory_footprint().host_activations
        loss.backward()
        after = model.memory_footprint().host_activations
        # Slices 0 and 1 each hold two saved tensors until backward (the last slice keeps its graph).
        assert waiting >= 4 * ROWS * WIDTH * 4 and after < waiting, (step, waiting, after)
        sizes.append((len(engine.pool.buffers()), engine.pool.nbytes))
    assert sizes[1] == sizes[2] == sizes[3], sizes


def test_steps_of_two_alternating_sizes_allocate_nothing_after_the_first_two():
    """A step keeps the buffers the step before took: batches of two sizes in turn (the last batch of
    an epoch, say) reuse them instead of freeing one size's at every other step's end."""
    model = OffloadModel(linear_tanh(), device="cpu", num_slices=3,
                         offload_activations=OffloadActivations(last=3, min_bytes=0))
    pool = engine_of(model).pool
    allocated: list[int] = []
    allocate = pool.allocate
    pool.allocate = lambda nbytes: allocated.append(nbytes) or allocate(nbytes)
    for step in range(6):
        if step == 2:
            allocated.clear()
        model(torch.randn(ROWS if step % 2 else 3 * ROWS, WIDTH)).sum().backward()
    assert allocated == []


@pytest.mark.parametrize("offloaded", [False, True], ids=["checkpointed", "offloaded"])
def test_forwards_that_no_backward_follows_do_not_grow_the_pool(offloaded):
    """An evaluation run without torch.no_grad() over batches of changing sizes: each forward
    takes buffers of new sizes, which no backward ages. The pool keeps this forward's and the one
    before's, and the training step's, which the next step takes again without allocating."""
    policy = OffloadActivations(last=3, min_bytes=0) if offloaded else None
    model = OffloadModel(linear_tanh(), device="cpu", num_slices=3, offload_activations=policy)
    pool = engine_of(model).pool
    allocated: list[int] = []
    allocate = pool.allocate
    pool.allocate = lambda nbytes: allocated.append(nbytes) or allocate(nbytes)

    def train_step() -> None:
        model(torch.randn(ROWS, WIDTH)).sum().backward()

    train_step()
    train_step()
    steady = len(pool.buffers())
    allocated.clear()
    per_forward = 0
    # A new size each time, none the step's (a gradient's buffer may be of an activation's size);
    # the graph dropped unused.
    for rows in range(4 * WIDTH, 4 * WIDTH + 30):
        before = len(allocated)
        model(torch.randn(rows, WIDTH)).sum()
        per_forward = max(per_forward, len(allocated) - before)
    assert per_forward > 0
    assert len(pool.buffers()) <= steady + 2 * per_forward, (len(pool.buffers()), steady, per_forward)
    allocated.clear()
    train_step()
    assert allocated == []  # the step's buffers outlived the evaluation
    # An evaluation forward of the step's own size takes the step's buffers too: still the step's.
    for rows in (ROWS, 2 * WIDTH, 3 * WIDTH):
        model(torch.randn(rows, WIDTH)).sum()
    allocated.clear()
    train_step()
    assert allocated == []


def test_microbatches_of_an_offloaded_slice_are_differentiated_from_their_own_saved_tensors():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                              nn.Linear(WIDTH, 2))
    x = torch.randn(8, WIDTH)
    grads = []
    for policy in (None, OffloadActivations(last=3, min_bytes=0)):
        model = OffloadModel(clone_model(reference), device="cpu", num_slices=3, num_microbatches=4,
                             offload_activations=policy)
        model(x).pow(2).sum().backward()
        grads.append(model)
    # The recompute and the offloaded tensors give the same microbatch gradients, summed alike.
    assert_same_grads(grads[1], grads[0], **EXACT)


# -- layouts and versions ---------------------------------------------------------------------------


class Gated(nn.Module):
    """Multiplies two halves of one projection: the product saves two views of one storage, each
    addressing nearly all of it (as attention's query, key and value do)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, 2 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.linear(x).chunk(2, dim=-1)
        return a * b


def test_views_of_one_storage_share_one_host_copy():
    torch.manual_seed(0)
    reference = nn.Sequential(Gated(), Gated(), nn.Linear(WIDTH, 1))
    model = OffloadModel(clone_model(reference), device="cpu", num_slices=3, checkpoint_activation=False,
                         offload_activations=OffloadActivations(slices=[0, 1], min_bytes=0))
    x = torch.randn(ROWS, WIDTH)
    reference(x).sum().backward()
    model(x).sum().backward()
    # Per slice: the Linear's input, and the projection once (not each half's addressed memory).
    assert engine_of(model).activations.saved_bytes == 2 * (ROWS * WIDTH + ROWS * 2 * WIDTH) * 4
    assert_same_grads(model, reference, **EXACT)


class UnsafeGated(nn.Module):
    """Splits a projection with ``unsafe_chunk`` and changes each half in place, as PyTorch's CPU
    GRU and LSTM cells split their gates: two aliases of one storage that are not views, each with
    a version counter of its own, saved by autograd at the same version (1)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, 2 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.linear(x).unsafe_chunk(2, dim=-1)
        return a.sigmoid_() * b.tanh_()


class Recurrent(nn.Module):
    """One of PyTorch's recurrent layers or cells, its output alone."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        out = out[0] if isinstance(out, tuple) else out
        return out


SEQUENCES = (2, ROWS, WIDTH)  # a batch of two sequences: one alone does not show it for GRU and LSTM


@pytest.mark.parametrize(("layer", "shape"), [
    (UnsafeGated, (ROWS, WIDTH)),
    (lambda: Recurrent(nn.GRU(WIDTH, WIDTH, batch_first=True)), SEQUENCES),
    (lambda: Recurrent(nn.GRUCell(WIDTH, WIDTH)), (ROWS, WIDTH)),
    (lambda: Recurrent(nn.LSTMCell(WIDTH, WIDTH)), (ROWS, WIDTH)),
    (lambda: Recurrent(nn.LSTM(WIDTH, WIDTH, batch_first=True).double()), SEQUENCES),
], ids=["unsafe_chunk", "GRU", "GRUCell", "LSTMCell", "LSTM-float64"])
def test_aliases_that_are_not_views_get_host_copies_of_their_own(layer, shape):
    torch.manual_seed(0)
    reference = nn.Sequential(layer(), nn.Linear(WIDTH, 1))
    dtype = next(reference.parameters()).dtype
    reference = reference.to(dtype)
    model = OffloadModel(clone_model(reference), device="cpu", num_slices=2, checkpoint_activation=False,
                         offload_activations=OffloadActivations(slices=[0], min_bytes=0))
    x = torch.randn(*shape, dtype=dtype)
    reference(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    assert engine_of(model).activations.saved_bytes > 0
    assert_same_grads(model, reference, **EXACT)


class SavesStrided(torch.autograd.Function):
    """Saves its input as given and checks backward gets it back in the same layout."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.layout = (x.shape, x.stride(), x.data_ptr() % 64)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        assert (x.shape, x.stride(), x.data_ptr() % 64) == ctx.layout
        return grad * 2 + 0 * x


class Strided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.linear(x)
        return SavesStrided.apply(torch.cat([wide, wide], dim=1)[:, 1::2].t()).t()


def test_saved_tensors_come_back_in_their_layout():
    torch.manual_seed(0)
    reference = nn.Sequential(Strided(), Strided(), nn.Linear(WIDTH, 1))
    model = OffloadModel(clone_model(reference), device="cpu", num_slices=3,
                         offload_activations=OffloadActivations(slices=[0, 1], min_bytes=0))
    x = torch.randn(ROWS, WIDTH)
    reference(x).sum().backward()
    model(x).sum().backward()
    assert engine_of(model).activations.saved_bytes > 0
    assert_same_grads(model, reference, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_convolutions(device):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten(),
                              nn.LazyLinear(2)).to(device)
    x = torch.randn(2, 3, 9, 9, device=device).to(memory_format=torch.channels_last)
    reference(x)  # materialise the lazy layer
    model = OffloadModel(clone_model(reference), device=device, num_slices=3,
                         offload_activations=OffloadActivations(last=3, min_bytes=0))
    out_ref = seeded(0, lambda: reference(x))
    out_off = seeded(0, lambda: model(x))
    out_ref.sum().backward()
    out_off.sum().backward()
    torch.testing.assert_close(out_off, out_ref, **EXACT)
    assert_same_grads(model, reference, **EXACT)


class DoublesSigmoidInPlace(nn.Module):
    """Changes a tensor that sigmoid saved: the plain model refuses its backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x)
        y.mul_(2)
        return y


def test_an_in_place_change_of_an_offloaded_saved_tensor_raises_as_in_pytorch():
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), DoublesSigmoidInPlace(), nn.Linear(4, 4), nn.Linear(4, 1))

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        build()(torch.randn(2, 4)).sum().backward()
    model = OffloadModel(build(), device="cpu", num_slices=3,
                         offload_activations=OffloadActivations(slices=[0], min_bytes=0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(2, 4)).sum().backward()
    # The model trains afterwards.
    model._modules["1"].forward = torch.sigmoid  # type: ignore[assignment]
    model(torch.randn(2, 4)).sum().backward()


@CUDA
def test_on_cuda_an_offloaded_slice_holds_no_device_memory_between_forward_and_backward():
    device = torch.device("cuda")
    width, rows = 1024, 4096  # 16 MiB per saved activation: well above what the allocator rounds

    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.Tanh())])

    x = torch.randn(rows, width, device=device)
    held = {}
    grads = {}
    for name, policy in (("kept", None), ("offloaded", OffloadActivations(slices=[0, 1, 2]))):
        model = OffloadModel(layers(), device=device, num_slices=4, checkpoint_activation=False,
                             offload_activations=policy)
        model(x).sum().backward()  # warm: pooled buffers, slots
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        loss = model(x).sum()
        torch.cuda.synchronize()
        # Memory an offload read is marked as used by the offload stream; the allocator takes it
        # back when it next looks at that stream's events, which emptying the cache makes it do.
        torch.cuda.empty_cache()
        held[name] = torch.cuda.memory_allocated(device) - before
        loss.backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        del model, loss
    # Kept: every slice's Tanh output, and the copy each later slice's input enters through, stay
    # on the device (seven activations); offloaded: only the last slice's, which keeps its graph
    # (its input, the copy it enters through, its Tanh output).
    activation = rows * width * 4
    assert held["kept"] >= 7 * activation, held
    assert held["offloaded"] <= 3 * activation + activation // 2, held
    for a, b in zip(grads["offloaded"], grads["kept"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
