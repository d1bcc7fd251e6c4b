"""OffloadOptimizer: the plain optimizer's results bit for bit, with the update on a host worker."""

from __future__ import annotations

import collections
import copy
import threading
import time
import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from offload import OffloadModel, OffloadOptimizer
from offload.tiers.slice_update import HostUpdateError

from .helpers import DEVICES

EXACT = {"rtol": 0.0, "atol": 0.0}

#: The implementations the issue names: default (per-tensor on the CPU), foreach and fused.
OPTIMIZERS = [
    pytest.param(torch.optim.AdamW, {"lr": 1e-2}, id="AdamW-default"),
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "foreach": True}, id="AdamW-foreach"),
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "fused": True, "weight_decay": 0.1}, id="AdamW-fused"),
    pytest.param(torch.optim.Adam, {"lr": 1e-2}, id="Adam-default"),
    pytest.param(torch.optim.Adam, {"lr": 1e-2, "foreach": True}, id="Adam-foreach"),
    pytest.param(torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}, id="Adam-amsgrad"),
    pytest.param(torch.optim.Adam, {"lr": 1e-2, "fused": True}, id="Adam-fused"),
    pytest.param(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, id="SGD-momentum"),
    pytest.param(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "foreach": True}, id="SGD-nesterov"),
]


def network(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def pair(cls, kwargs, compute_dtype=None, num_slices=3, device="cpu"):
    """The plain optimizer on an OffloadModel and OffloadOptimizer on a twin: the only difference
    is who steps the host parameters."""
    plain_model = OffloadModel(network(), device=device, num_slices=num_slices, compute_dtype=compute_dtype)
    model = OffloadModel(network(), device=device, num_slices=num_slices, compute_dtype=compute_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-tensor warning, about the reference itself
        plain = cls(plain_model.parameters(), **kwargs)
    return (plain_model, plain), (model, OffloadOptimizer(model, cls, **kwargs))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    device = model.device if isinstance(model, OffloadModel) else next(model.parameters()).device
    return model(batch(step).to(device)).float().pow(2).mean()


def train_both(plain_model, plain, model, optimizer, steps) -> None:
    """Each model a step on each of ``steps``' batches, by its optimizer."""
    for step in steps:
        for m, opt in ((plain_model, plain), (model, optimizer)):
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()


def assert_same(model_a, opt_a, model_b, opt_b) -> None:
    opt_b.synchronize() if isinstance(opt_b, OffloadOptimizer) else None
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"{name}: {m}")
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    assert state_a["state"].keys() == state_b["state"].keys()
    for k in state_a["state"]:
        assert state_a["state"][k].keys() == state_b["state"][k].keys()
        for name in state_a["state"][k]:
            torch.testing.assert_close(state_b["state"][k][name], state_a["state"][k][name], **EXACT)


def assert_same_where_held(model_a, opt_a, model_b, opt_b) -> None:
    """As :func:`assert_same`, reading the state where it is held: after a failure it latched, an
    OffloadOptimizer's ``state_dict()`` refuses until a load."""
    opt_b.synchronize()
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"{name}: {m}")
    for a, b in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        assert opt_a.state[a].keys() == opt_b.state[b].keys()
        for key in opt_a.state[a]:
            torch.testing.assert_close(opt_b.state[b][key], opt_a.state[a][key], **EXACT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS)
def test_steps_equal_the_plain_optimizer(cls, kwargs, compute_dtype, device):
    (plain_model, plain), (model, optimizer) = pair(cls, kwargs, compute_dtype, device=device)
    for step in range(4):
        for m, opt in ((plain_model, plain), (model, optimizer)):
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()
    assert_same(plain_model, plain, model, optimizer)


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_global_step_hooks_run_once_a_step_as_for_the_plain_optimizer(update_in_backward):
    # register_optimizer_step_pre_hook / _post_hook: once per step() of the user's optimizer, on
    # the caller's thread, not again for each slice's update.
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model = OffloadModel(network(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=update_in_backward)
    seen: list[tuple[str, str, bool]] = []
    main = threading.get_ident()
    handles = [register(lambda opt, args, kwargs, when=when: seen.append(
                   (when, type(opt).__name__, threading.get_ident() == main)))
               for when, register in (("pre", register_optimizer_step_pre_hook),
                                      ("post", register_optimizer_step_post_hook))]
    try:
        for step in range(2):
            loss_of(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        optimizer.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [("pre", "OffloadOptimizer", True), ("post", "OffloadOptimizer", True)] * 2


@pytest.mark.parametrize("device", DEVICES)
def test_schedulers_clipping_accumulation_and_groups(device):
    (plain_model, plain), (model, optimizer) = pair(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, device=device)
    for opt, m in ((plain, plain_model), (optimizer, model)):
        # A second group with its own learning rate: the last two layers.
        last = list(m.parameters())[-4:]
        opt.param_groups[0]["params"] = [p for p in m.parameters() if all(p is not q for q in last)]
        opt.add_param_group({"params": last, "lr": 3e-3, "weight_decay": 0.0})
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 5e-3], total_steps=8)
                  for opt in (plain, optimizer)]
    for step in range(4):
        for m, opt, scheduler in ((plain_model, plain, schedulers[0]), (model, optimizer, schedulers[1])):
            for micro in range(3):  # accumulation over three backwards
                (loss_of(m, 10 * step + micro) / 3).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
            opt.step()
            scheduler.step()  # right after step(): the pending update keeps its learning rate
            opt.zero_grad(set_to_none=step % 2 == 0)
    assert_same(plain_model, plain, model, optimizer)


@pytest.mark.parametrize("fused", [False, True])
def test_a_learning_rate_set_by_hand_is_followed(fused):
    (plain_model, plain), (model, optimizer) = pair(torch.optim.AdamW, {"lr": 1e-2, "fused": fused})
    for step in range(4):
        for m, opt in ((plain_model, plain), (model, optimizer)):
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()
            # Right after step(): the pending update keeps the rate it was started with.
            opt.param_groups[0]["lr"] = 1e-2 / (step + 2)
    assert_same(plain_model, plain, model, optimizer)


@pytest.mark.parametrize("fused", [False, True])
def test_tensor_betas_changed_in_place_right_after_step_leave_the_pending_update_alone(fused):
    """Betas as 0-d tensors, filled in place after step() as a compiled step's schedule does: the
    pending update keeps the values step() saw, the tensors inside the tuple copied too."""
    models = [OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16) for _ in range(2)]
    def settings():  # tensors of each optimizer's own
        return {"lr": 1e-2, "fused": fused, "betas": (torch.tensor(0.9), torch.tensor(0.999))}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-tensor warning, about the reference itself
        optimizers = [torch.optim.Adam(models[0].parameters(), **settings()),
                      OffloadOptimizer(models[1], torch.optim.Adam, **settings())]

    def late(optimizer, args, kwargs):  # the updates start after the change below, every time
        if getattr(optimizer, "_offload_inner", False):
            time.sleep(0.02)

    handle = register_optimizer_step_pre_hook(late)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the per-tensor warning
            for step in range(4):
                for m, opt in zip(models, optimizers):
                    opt.zero_grad()
                    loss_of(m, step).backward()
                    opt.step()
                    opt.param_groups[0]["betas"][0].fill_(0.5 + 0.1 * step)
    finally:
        handle.remove()
    assert_same(models[0], optimizers[0], models[1], optimizers[1])


#: torch.optim classes whose __setstate__ turns state saved as numbers (PyTorch before 1.12) into tensors.
NUMBER_STATE = [
    pytest.param(torch.optim.Adam, {"lr": 1e-2}, ("step",), id="Adam"),
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "fused": True}, ("step",), id="AdamW-fused"),
    pytest.param(torch.optim.Adagrad, {"lr": 0.1}, ("step",), id="Adagrad"),
    pytest.param(torch.optim.ASGD, {"lr": 1e-2}, ("step", "eta", "mu"), id="ASGD"),
    pytest.param(torch.optim.NAdam, {"lr": 1e-2}, ("step", "mu_product"), id="NAdam"),
]


@pytest.mark.parametrize("cls, kwargs, numbers", NUMBER_STATE)
def test_a_state_dict_in_an_older_format_loads_as_the_class_loads_it(cls, kwargs, numbers):
    """Through the class's own __setstate__: scalars saved as Python numbers become tensors (the
    update raised on them), and group keys the checkpoint lacks take the class's defaults, not this
    optimizer's settings (Adam built with maximize=True, a checkpoint without the key: False)."""
    (plain_model, plain), (model, optimizer) = pair(cls, {**kwargs, "maximize": True})
    train_both(plain_model, plain, model, optimizer, range(2))
    older = copy.deepcopy(plain.state_dict())
    for state in older["state"].values():
        state.update({key: state[key].item() for key in numbers})
    for group in older["param_groups"]:
        del group["maximize"]
    for opt in (plain, optimizer):
        opt.load_state_dict(copy.deepcopy(older))
    assert optimizer.param_groups[0]["maximize"] is plain.param_groups[0]["maximize"] is False
    train_both(plain_model, plain, model, optimizer, range(2, 4))
    assert_same(plain_model, plain, model, optimizer)


def test_a_new_state_dict_set_right_after_step_waits_for_the_pending_update():
    """``optimizer.state = defaultdict(dict)``, a reset of Adam: the update under way wrote the
    state it creates into the new dict (a step count of 3 where the plain optimizer starts at 1)."""
    (plain_model, plain), (model, optimizer) = pair(torch.optim.AdamW, {"lr": 1e-2, "fused": True},
                                                    compute_dtype=torch.bfloat16)

    def late(inner, args, kwargs):  # the updates run after the reset below
        if getattr(inner, "_offload_inner", False):
            time.sleep(0.02)

    handle = register_optimizer_step_pre_hook(late)
    try:
        for step in range(4):
            for m, opt in ((plain_model, plain), (model, optimizer)):
                opt.zero_grad()
                loss_of(m, step).backward()
                opt.step()
                if step == 1:
                    opt.state = collections.defaultdict(dict)
    finally:
        handle.remove()
    assert_same(plain_model, plain, model, optimizer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unscale_and_clip", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])  # False: backward adds into the zeroed .grad
def test_grad_scaler_steps_and_skips_like_the_plain_optimizer(set_to_none, fused, unscale_and_clip, device):
    (plain_model, plain), (model, optimizer) = pair(torch.optim.AdamW, {"lr": 1e-2, "fused": fused}, device=device)
    # The scaler of the device the loss is on, as a user would make it; the gradients it unscales
    # are on the host either way.
    scalers = [torch.amp.GradScaler(device, init_scale=2.0**8) for _ in range(2)]
    for step in range(4):
        for m, opt, scaler in ((plain_model, plain, scalers[0]), (model, optimizer, scalers[1])):
            opt.zero_grad(set_to_none=set_to_none)
            loss = loss_of(m, step)
            if step == 2:
                loss = loss * float("inf")  # an overflow: the step is skipped
            scaler.scale(loss).backward()
            if unscale_and_clip:  # the recipe in docs/mixed-precision.md
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
            scaler.step(opt)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert_same(plain_model, plain, model, optimizer)


def test_state_dicts_move_both_ways():
    (plain_model, plain), (model, optimizer) = pair(torch.optim.AdamW, {"lr": 1e-2, "foreach": True})
    for step in range(2):
        for m, opt in ((plain_model, plain), (model, optimizer)):
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()
    # Swap the optimizer states: each continues from the other's checkpoint.
    from_plain, from_offload = copy.deepcopy(plain.state_dict()), copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(from_plain)
    plain.load_state_dict(from_offload)
    train_both(plain_model, plain, model, optimizer, range(2, 4))
    assert_same(plain_model, plain, model, optimizer)


@pytest.mark.parametrize("device", DEVICES)
def test_a_whole_model_saves_loads_and_trains_on(tmp_path, device):
    model = OffloadModel(network(), device=device, num_slices=3, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    loss_of(model, 0).backward()
    optimizer.step()  # pending while the model is saved: saving waits for it
    torch.save(model, tmp_path / "model.pt")
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert isinstance(loaded, OffloadModel) and loaded.partition == model.partition
    assert loaded.compute_dtype == torch.bfloat16
    loaded_optimizer = OffloadOptimizer(loaded, torch.optim.AdamW, lr=1e-2, fused=True)
    loaded_optimizer.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
    assert_same(model, optimizer, loaded, loaded_optimizer)
    for step in range(1, 3):  # both train on, with memory of their own
        for m, opt in ((model, optimizer), (loaded, loaded_optimizer)):
            opt.zero_grad()
            loss_of(m, step).backward()
            opt.step()
    assert_same(model, optimizer, loaded, loaded_optimizer)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(model.parameters(), loaded.parameters()))
    assert copy.copy(loaded)._engine is loaded._engine  # a shallow copy shares, as before


def test_parameters_outside_the_model_are_stepped_too():
    model = OffloadModel(network(), device="cpu", num_slices=3)
    scale = nn.Parameter(torch.ones(3))
    reference_model, reference_scale = copy.deepcopy(network()), nn.Parameter(torch.ones(3))
    optimizer = OffloadOptimizer(model, torch.optim.SGD, [{"params": model.parameters()}, {"params": [scale]}],
                                 lr=0.1, momentum=0.9)
    plain = torch.optim.SGD([{"params": reference_model.parameters()}, {"params": [reference_scale]}],
                            lr=0.1, momentum=0.9, foreach=False)
    for step in range(3):
        for m, s, opt in ((model, scale, optimizer), (reference_model, reference_scale, plain)):
            opt.zero_grad()
            (m(batch(step)) * s).pow(2).mean().backward()
            opt.step()
    optimizer.synchronize()
    torch.testing.assert_close(scale, reference_scale, **EXACT)
    for a, b in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, **EXACT)


# -- overlap and what waits for it -----------------------------------------------------------------


class Recorded(torch.optim.SGD):
    """SGD that notes when each slice's update starts and ends, can be held back until an event,
    and can fail."""

    log: list[tuple[str, int]] = []
    hold: dict[int, threading.Event] = {}
    timed_out: list[int] = []
    fail_on: int | None = None
    thread_count: list[int] = []
    tag_of: dict[int, int] = {}

    def step(self, closure=None):
        tag = Recorded.tag_of.get(self.param_groups[0]["params"][0].data_ptr(), -1)
        Recorded.log.append(("start", tag))
        Recorded.thread_count.append(torch.get_num_threads())
        if Recorded.fail_on == tag:
            raise MemoryError("no memory for the optimizer state (simulated)")
        if tag in Recorded.hold and not Recorded.hold[tag].wait(timeout=10):
            Recorded.timed_out.append(tag)
        result = super().step(closure)
        Recorded.log.append(("end", tag))
        return result


def first_step(model: OffloadModel, optimizer: OffloadOptimizer) -> None:
    """A step before the one a test watches: the first of a class outside ``torch.optim`` waits for
    its updates, to see whether they draw random numbers (Note: [An optimizer that draws random
    numbers] in ``offload/optimizing/random_draws.py``); Recorded draws none, and overlaps after it."""
    model(batch(9)).sum().backward()
    optimizer.step()
    optimizer.synchronize()
    optimizer.zero_grad()


def recorded(model: OffloadModel) -> None:
    Recorded.log, Recorded.thread_count, Recorded.hold, Recorded.timed_out, Recorded.fail_on = [], [], {}, [], None
    Recorded.tag_of = {s.storage.params[0].tensor.data_ptr(): s.index for s in model._engine.slices}


def recorded_model(num_slices: int = 4) -> OffloadModel:
    model = OffloadModel(network(), device="cpu", num_slices=num_slices)
    recorded(model)
    return model


class Timed(nn.Module):
    """A layer that notes when it runs, and lets the update of another slice go on."""

    def __init__(self, inner: nn.Module, index: int, releases: int | None = None):
        super().__init__()
        self.inner, self.index, self.releases = inner, index, releases

    def forward(self, x):
        Recorded.log.append(("forward", self.index))
        if self.releases is not None and self.releases in Recorded.hold:
            Recorded.hold[self.releases].set()
        return self.inner(x)


def test_the_next_forward_overlaps_the_update_of_later_slices():
    torch.manual_seed(0)
    layers = [Timed(nn.Linear(6, 6), k, releases=3 if k == 0 else None) for k in range(4)]
    model = OffloadModel(layers, device="cpu")
    recorded(model)
    optimizer = OffloadOptimizer(model, Recorded, lr=0.1)
    first_step(model, optimizer)
    model(batch(0)).sum().backward()
    Recorded.log.clear()
    # Slice 0's update waits until step() has returned; slice 3's until slice 0 has computed.
    Recorded.hold = {0: threading.Event(), 3: threading.Event()}
    optimizer.step()
    Recorded.hold[0].set()  # had step() waited for the update, the test would have hung until here
    model(batch(1))
    assert not Recorded.timed_out, "the forward waited for every update before it started"
    order = Recorded.log
    for k in range(4):
        # Each slice computes only after its own update...
        assert order.index(("forward", k)) > order.index(("end", k))
    # ...and slice 0 computed while slice 3 was still being updated.
    assert order.index(("forward", 0)) < order.index(("end", 3))


def test_reads_through_the_model_and_the_optimizer_wait_for_the_update():
    model = recorded_model()
    optimizer = OffloadOptimizer(model, Recorded, lr=0.1)
    model(batch(0)).sum().backward()
    expected = OffloadModel(network(), device="cpu", num_slices=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = torch.optim.SGD(expected.parameters(), lr=0.1)
    expected(batch(0)).sum().backward()
    ema_of = {id(m): AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.5)) for m in (model, expected)}

    def values(tensors):
        return [t.detach().clone() for t in tensors]

    def ema(m):  # an EMA helper, reading the parameters right after step()
        ema_of[id(m)].update_parameters(m)
        return values(ema_of[id(m)].module.parameters())

    def through_optimizer(read):
        def run(m):
            if m is model:
                read()
            return []
        return run

    # Each read, applied to the model right after step() and to the reference after its plain
    # step, must see the same values.
    reads = [
        lambda m: values(m.parameters()),
        lambda m: values(p for _, p in m.named_parameters()),
        lambda m: values(p for module in m.modules() for p in module.parameters(recurse=False)),
        lambda m: values(p for _, module in m.named_modules() for p in module.parameters(recurse=False)),
        lambda m: values(p for child in m.children() for p in child.parameters()),
        lambda m: values(m.state_dict().values()),
        lambda m: values(m.get_submodule("0").parameters()),
        ema,
        through_optimizer(optimizer.state_dict),
        through_optimizer(optimizer.synchronize),
    ]
    for k, read in enumerate(reads):
        optimizer.step()  # the same gradients every time: identical updates
        seen = read(model)
        assert not model._engine.updates.pending(), f"read {k} did not wait"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain.step()
        for a, b in zip(seen, read(expected), strict=True):
            torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"read {k}: {m}")
    for a, b in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, **EXACT)


class Sleepy(torch.optim.SGD):
    """SGD that starts late: right after ``step()`` its state is not made yet."""

    def step(self, closure=None):
        time.sleep(0.2)
        return super().step(closure)


def test_reading_the_state_waits_for_the_update_and_leaves_it_pending():
    # Lightning walks optimizer.state at teardown, right after the last step().
    model = OffloadModel(network(), device="cpu", num_slices=4)
    optimizer = OffloadOptimizer(model, Sleepy, lr=0.1, momentum=0.9, fused=True)
    expected = network()
    plain = torch.optim.SGD(expected.parameters(), lr=0.1, momentum=0.9, fused=True)
    model(batch(0)).sum().backward()
    expected(batch(0)).sum().backward()
    optimizer.step()
    plain.step()
    state = {p: dict(s) for p, s in optimizer.state.items()}
    # Left pending, as after zero_grad(set_to_none=False): under a compute_dtype the next forward
    # keeps the shadows the update wrote.
    assert model._engine.updates.pending()
    assert len(state) == len(plain.state) == len(list(expected.parameters()))
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(state[p]["momentum_buffer"], plain.state[q]["momentum_buffer"], **EXACT)


def test_train_and_eval_do_not_wait_for_the_update():
    model = recorded_model()
    optimizer = OffloadOptimizer(model, Recorded, lr=0.1)
    model(batch(0)).sum().backward()
    optimizer.step()
    model.eval()
    model.train()
    assert model._engine.updates.pending()
    assert all(m.training for m in model.modules())
    assert not model._engine.updates.pending()  # modules() waited


def test_a_failing_update_surfaces_at_the_next_call_and_leaves_later_slices_untouched():
    model = recorded_model(num_slices=4)
    optimizer = OffloadOptimizer(model, Recorded, lr=0.1)
    first_step(model, optimizer)
    model(batch(0)).sum().backward()
    before = [p.detach().clone() for p in model._engine.parameters()]
    slice_of = [s.index for s in model._engine.slices for _ in s.storage.params]
    Recorded.fail_on = 2
    optimizer.step()
    with pytest.raises(HostUpdateError, match="slice 2") as raised:
        model(batch(1))
    assert isinstance(raised.value.__cause__, MemoryError)
    for p, old, index in zip(model._engine.parameters(), before, slice_of):
        assert torch.equal(p, old) == (index >= 2), f"slice {index}"
    # Training goes on once the cause is gone.
    Recorded.fail_on = None
    optimizer.zero_grad()
    model(batch(2)).sum().backward()
    optimizer.step()
    optimizer.synchronize()


class FailsOn(torch.optim.SGD):
    """SGD that raises, before changing anything, when it is asked to step the tensor whose
    memory starts at ``target``."""

    target: int | None = None

    def step(self, closure=None):
        if any(p.data_ptr() == FailsOn.target for group in self.param_groups for p in group["params"]):
            raise MemoryError("no memory for a temporary (simulated)")
        return super().step(closure)


@pytest.mark.parametrize("device", DEVICES)
def test_a_failure_before_any_change_leaves_the_whole_slice_unchanged_with_a_shadow(device):
    # With compute_dtype the update also writes the shadow; the failing parameter is the last of
    # its slice, so anything that stepped the slice's parameters a part at a time would already
    # have changed the others (see Note: [Whole-slice update] in offload/tiers/slice_update.py).
    model = OffloadModel(network(), device=device, num_slices=2, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, FailsOn, lr=0.1, momentum=0.9)
    FailsOn.target = None
    for step in range(2):  # the second step finds the momentum state in place
        loss_of(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    loss_of(model, 2).backward()
    slices = model._engine.slices
    before = [[e.tensor.detach().clone() for e in s.storage.params] for s in slices]
    FailsOn.target = slices[0].storage.params[-1].tensor.data_ptr()
    optimizer.step()
    with pytest.raises(HostUpdateError, match="slice 0"):
        optimizer.synchronize()
    for s, old in zip(slices, before):
        for e, value in zip(s.storage.params, old):
            assert torch.equal(e.tensor, value), f"slice {s.index} changed"
    # The next forward loads the masters as they are, and training goes on.
    FailsOn.target = None
    plain = OffloadModel(copy.deepcopy(network()), device=device, num_slices=2, compute_dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    x = batch(3).to(device)
    torch.testing.assert_close(model(x), plain(x), **EXACT)
    optimizer.step()
    optimizer.synchronize()


class ChangesThenFails(torch.optim.SGD):
    """SGD that raises *after* changing the parameters, when it steps the tensor whose memory
    starts at ``target``."""

    target: int | None = None

    def step(self, closure=None):
        result = super().step(closure)
        if any(p.data_ptr() == ChangesThenFails.target for group in self.param_groups for p in group["params"]):
            raise MemoryError("no memory for a temporary (simulated)")
        return result


@pytest.mark.parametrize("masters", ["ram", "disk"])
@pytest.mark.parametrize("surfaces", ["forward", "synchronize", "zero_grad"])
def test_a_slice_changed_by_a_failed_update_is_cast_again_wherever_the_error_surfaces(surfaces, masters, tmp_path):
    # The update of slice 1 changes its masters, then raises before writing the shadow. Its error
    # is raised by the first wait on the worker, which may be the wait for slice 0 (here always:
    # the worker has run every update when the caller first waits); the next forward must cast
    # slice 1 again all the same.
    from offload import DiskTier

    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16,
                         masters=DiskTier(tmp_path) if masters == "disk" else None)
    optimizer = OffloadOptimizer(model, ChangesThenFails, lr=0.1, fused=True)
    ChangesThenFails.target = None
    loss_of(model, 0).backward()
    optimizer.step()
    optimizer.zero_grad()
    loss_of(model, 1).backward()
    ChangesThenFails.target = model._engine.slices[1].storage.params[-1].tensor.data_ptr()
    optimizer.step()
    worker = optimizer._updates.worker
    while worker.finished < worker.submitted:
        time.sleep(0.001)
    with pytest.raises(HostUpdateError, match="slice 1"):
        if surfaces == "forward":
            model(batch(2))
        elif surfaces == "synchronize":
            optimizer.synchronize()
        else:
            optimizer.zero_grad(set_to_none=False)
    ChangesThenFails.target = None
    x = batch(3)
    with torch.no_grad():
        got = model(x)
    # The same masters in a new model: every shadow cast from them.
    plain = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(got, plain(x), **EXACT)
    optimizer.step()
    optimizer.synchronize()


def test_worker_thread_count_is_set_and_checked():
    model = recorded_model()
    optimizer = OffloadOptimizer(model, Recorded, lr=0.1, num_threads=1)
    model(batch(0)).sum().backward()
    optimizer.step()
    optimizer.synchronize()
    assert set(Recorded.thread_count) == {1}
    assert threading.current_thread() is threading.main_thread()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_threads"):
            OffloadOptimizer(model, torch.optim.SGD, lr=0.1, num_threads=bad)


def test_bad_arguments_get_clear_errors():
    model = OffloadModel(network(), device="cpu", num_slices=2)
    with pytest.raises(TypeError, match="steps an OffloadModel"):
        OffloadOptimizer(network(), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        OffloadOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="closure"):
        OffloadOptimizer(model, torch.optim.LBFGS)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        OffloadOptimizer(model, torch.optim.SGD, lr=-1.0)


class _ScheduleFree(torch.optim.SGD):
    """The contract of the schedulefree package's optimizers: the parameters moved between two
    points by train() and eval(), which the Hugging Face Trainer calls when the optimizer has them."""

    def train(self) -> None: ...

    def eval(self) -> None: ...


def test_a_schedule_free_optimizer_is_refused_with_the_way_that_trains_it():
    model = OffloadModel(network(), device="cpu", num_slices=2)
    with pytest.raises(ValueError, match=r"_ScheduleFree has train\(\) and eval\(\) of its own .* "
                                         r"_ScheduleFree\(model.parameters\(\), ...\)"):
        OffloadOptimizer(model, _ScheduleFree, lr=0.1)
    torch.optim.SGD(model.parameters(), lr=0.1)  # that way works: the model's parameters are its host copies


def test_the_compute_dtype_shadow_is_written_by_the_update_not_by_the_forward():
    model = OffloadModel(network(), device="cpu", num_slices=3, compute_dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    refreshes = []
    for storage in (s.storage for s in model._engine.slices):
        original = storage.refresh_shadow

        def counted(original=original):
            refreshes.append(1)
            original()
        storage.refresh_shadow = counted
    for step in range(3):
        loss_of(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    # Only the first forward casts (no update has written the shadows yet).
    assert len(refreshes) == model.num_slices


class _MyAdamW(torch.optim.AdamW):
    """A user's subclass, for the warning's spelling of it."""


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "OffloadOptimizer"])
def test_an_optimizer_without_fused_on_offloaded_parameters_warns_once(monkeypatch, wrapped):
    from offload import per_tensor_warning

    model = OffloadModel(network(), device="cpu", num_slices=2)
    cases = (({"fused": True}, None), ({"foreach": True}, "with foreach=True"), ({}, "per-tensor"))
    for kwargs, warns in cases:
        monkeypatch.setitem(per_tensor_warning._state, "warned", False)
        if wrapped:
            optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, **kwargs)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
        loss_of(model, 0).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
            optimizer.step()
        messages = [str(w.message) for w in caught if "slower than fused=True" in str(w.message)]
        assert len(messages) == (0 if warns is None else 1), messages
        if warns is not None:
            assert warns in messages[0] and "AdamW" in messages[0]
            assert ("OffloadOptimizer(model, torch.optim.AdamW, ..., fused=True)" in messages[0])
    # A subclass is named as the user would import it, not as a torch.optim class that does not exist.
    monkeypatch.setitem(per_tensor_warning._state, "warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OffloadOptimizer(model, _MyAdamW, lr=1e-3).step()
    messages = [str(w.message) for w in caught if "slower than fused=True" in str(w.message)]
    assert f"OffloadOptimizer(model, {__name__}._MyAdamW, ..., fused=True)" in messages[0]
    # An optimizer without a fused implementation has nothing better to offer: no warning.
    monkeypatch.setitem(per_tensor_warning._state, "warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.optim.RMSprop(model.parameters(), lr=1e-3).step()
    assert not [w for w in caught if "slower than fused=True" in str(w.message)]


def test_a_parameter_replaced_through_a_reference_taken_before_step_is_laid_out_after_the_update():
    # The reference skips the wait that attribute access through the model does: the forward that
    # lays the slice out again waits for the update still writing its host copies.
    def run(wrap):
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        model = OffloadModel(layers, device="cpu", num_slices=3) if wrap else layers
        first = layers[0]
        optimizer = (OffloadOptimizer(model, torch.optim.SGD, lr=0.1, fused=True) if wrap
                     else torch.optim.SGD(model.parameters(), lr=0.1, fused=True))
        model(batch(0)[:, :4]).sum().backward()
        optimizer.step()
        first.weight = nn.Parameter(torch.ones(4, 4))
        return model(batch(1)[:, :4])

    torch.testing.assert_close(run(True), run(False), **EXACT)
