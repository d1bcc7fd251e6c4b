"""An adversarial review of resident slices (``OffloadModel(..., resident_slices=k)``, Note:
[Resident slices] in ``offload/streams/resident_storage.py``), as tests: the places users go, each
compared bit for bit with the plain model and a plain ``torch.optim`` optimizer on the CPU, or with
the same OffloadModel streaming every slice (``resident_slices=0``) where no plain model computes
the same bits (microbatches, compute dtypes, loss scaling)."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import offload
from offload import DiskTier, OffloadActivations, OffloadModel, OffloadOptimizer
from offload.streamcheck import StreamChecker

from . import stream_scenarios
from .helpers import ACTIVATIONS, CUDA
from .test_optimizer import assert_same, batch, network
from .test_update_in_backward import plain_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

EXACT = {"rtol": 0.0, "atol": 0.0}
NUM_SLICES = 4


def resident_model(layers: Any, resident: int, **settings: Any) -> OffloadModel:
    settings.setdefault("num_slices", NUM_SLICES)
    return OffloadModel(layers, device="cpu", resident_slices=resident, **settings)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    return model(batch(step)).float().pow(2).mean()


def train_both(plain: nn.Module, plain_opt: torch.optim.Optimizer, model: OffloadModel,
               optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            loss_of(m, step).backward()
            opt.step()
            opt.zero_grad()


# -- 1. activations: recomputed, kept, offloaded ----------------------------------------------------


@pytest.mark.parametrize("resident", [1, NUM_SLICES])
@pytest.mark.parametrize("activations", sorted(ACTIVATIONS))
def test_every_way_of_keeping_activations_trains_like_the_plain_model(activations, resident):
    plain = network()
    model = resident_model(network(), resident, **ACTIVATIONS[activations])
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        outs = []
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            out = m(batch(step))
            out.pow(2).mean().backward()
            outs.append(out.detach())
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(outs[1], outs[0], **EXACT)
    assert_same(plain, plain_opt, model, optimizer)


def offloaded_with_microbatches(resident: int) -> list[torch.Tensor]:
    """Offloaded saved tensors of resident and streamed slices, two microbatches, bfloat16, a
    BatchNorm whose buffers change: outputs, parameters and buffers after three steps."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                           nn.Dropout(0.1), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    model = resident_model(layers, resident, num_microbatches=2, compute_dtype=torch.bfloat16,
                           checkpoint_activation=False, offload_activations=OffloadActivations(last=1_000, min_bytes=0))
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    seen = []
    for step in range(3):
        torch.manual_seed(step)
        out = model(batch(step))
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(out.detach().clone())
    optimizer.synchronize()
    return seen + [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def test_offloaded_activations_of_resident_slices_with_microbatches_and_compute_dtype():
    """The same bits as the model streaming every slice, and under the checker."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "OffloadModel with num_microbatches > 1 runs BatchNorm")
        expected = offloaded_with_microbatches(0)
        assert same(expected, offloaded_with_microbatches(2))
        with StreamChecker(schedule="random", seed=3) as checker:
            checked = offloaded_with_microbatches(2)
    assert not checker.races, checker.summary()
    assert same(expected, checked)


# -- 2. loss scaling and clipping -------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("unscale_and_clip", [False, True])
def test_grad_scaler_with_resident_slices_steps_and_skips_like_the_plain_optimizer(compute_dtype, fused,
                                                                                   unscale_and_clip):
    """``offload.GradScaler`` over a model whose first slices keep their gradients on the device:
    the same scale, skipped step and parameters as the plain optimizer on the streamed twin."""
    settings = {"compute_dtype": compute_dtype}
    reference = resident_model(network(), 0, **settings)
    model = resident_model(network(), 2, **settings)
    plain = plain_optimizer(torch.optim.AdamW, reference.parameters(), {"lr": 1e-2, "fused": fused})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=fused)
    scalers = [offload.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    for step in range(4):
        for m, opt, scaler in ((reference, plain, scalers[0]), (model, optimizer, scalers[1])):
            opt.zero_grad(set_to_none=step % 2 == 0)
            loss = loss_of(m, step)
            if step == 2:
                loss = loss * float("inf")  # an overflow: the step is skipped
            scaler.scale(loss).backward()
            if unscale_and_clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
            scaler.step(opt)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert_same(reference, plain, model, optimizer)


def test_clipping_schedulers_groups_and_zeroed_gradients():
    """``clip_grad_norm_`` over resident and host gradients, a scheduler, two parameter groups
    (one spanning resident and streamed slices), zeroed gradients kept between steps."""
    plain, model = network(), resident_model(network(), 2)

    def groups(m: nn.Module) -> list[dict[str, Any]]:
        params = list(m.parameters())
        return [{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}]

    plain_opt = plain_optimizer(torch.optim.AdamW, groups(plain), {"lr": 1e-2, "weight_decay": 0.1})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, groups(model), lr=1e-2, weight_decay=0.1)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain_opt, optimizer)]
    for step in range(4):
        for m, opt, sched in ((plain, plain_opt, schedulers[0]), (model, optimizer, schedulers[1])):
            opt.zero_grad(set_to_none=False)
            loss_of(m, step).backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
            opt.step()
            sched.step()
        assert norm.item() > 0
    assert_same(plain, plain_opt, model, optimizer)


# -- 3. the optimizer around the model --------------------------------------------------------------


def test_parameters_outside_the_model_and_a_group_added_mid_training():
    plain, model = network(), resident_model(network(), 1)
    extras = [nn.Parameter(torch.ones(3)) for _ in range(2)]
    later = [nn.Parameter(torch.full((2,), 0.5)) for _ in range(2)]
    plain_opt = plain_optimizer(torch.optim.AdamW, [*plain.parameters(), extras[0]], {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, [*model.parameters(), extras[1]], lr=1e-2)
    for step in range(4):
        if step == 2:
            plain_opt.add_param_group({"params": [later[0]], "lr": 1e-3})
            optimizer.add_param_group({"params": [later[1]], "lr": 1e-3})
        for m, opt, extra, late in ((plain, plain_opt, extras[0], later[0]), (model, optimizer, extras[1], later[1])):
            (loss_of(m, step) + extra.sum() * loss_of(m, step).detach() + late.pow(2).sum()).backward()
            opt.step()
            opt.zero_grad()
    assert_same(plain, plain_opt, model, optimizer)
    torch.testing.assert_close(extras[1], extras[0], **EXACT)
    torch.testing.assert_close(later[1], later[0], **EXACT)


def test_optimizer_state_dict_round_trip_with_the_plain_optimizer():
    """A plain optimizer's state dict loaded into OffloadOptimizer over a resident model (and
    OffloadOptimizer's loaded back into a plain one), then both train on: the same bits."""
    plain, model = network(), resident_model(network(), 2)
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    train_both(plain, plain_opt, model, optimizer, steps=2)
    # Swap: each optimizer takes the other's state, which must be the same.
    theirs = copy.deepcopy(plain_opt.state_dict())
    ours = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(theirs)
    plain_opt.load_state_dict(ours)
    for p in (entry.tensor for s in model._engine.slices[:2] for entry in s.storage.params):
        # torch.optim puts loaded state on its parameter's device: beside a resident parameter.
        assert all(value.device == p.device for value in optimizer.state[p].values() if value.dim())
    train_both(plain, plain_opt, model, optimizer, steps=2)
    assert_same(plain, plain_opt, model, optimizer)


def test_a_second_offload_optimizer_takes_over():
    """The first OffloadOptimizer deleted and a new one loaded with its state dict: the resident
    slices' state goes to the new one, which steps them on the device from then on."""
    plain, model = network(), resident_model(network(), 1)
    plain_opt = plain_optimizer(torch.optim.SGD, plain.parameters(), {"lr": 0.1, "momentum": 0.9})
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    train_both(plain, plain_opt, model, optimizer, steps=2)
    state = optimizer.state_dict()
    del optimizer
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    optimizer.load_state_dict(state)
    train_both(plain, plain_opt, model, optimizer, steps=2)
    assert_same(plain, plain_opt, model, optimizer)


def test_a_failing_update_of_a_resident_slice_leaves_the_later_slices_as_the_error_says():
    """AdamW refuses the sparse gradient of the resident first slice: as with every slice streamed,
    the slices after it must be left as they were, as the error says."""
    model = OffloadModel(sparse_network(), device="cpu", num_slices=3, resident_slices=1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=0.1)
    ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(0))
    model(ids).pow(2).mean().backward()
    with pytest.raises(offload.HostUpdateError, match="slices after it were left as they were"):
        optimizer.step()
        optimizer.synchronize()
    for (name, p), old in zip(model.named_parameters(), before):
        torch.testing.assert_close(p, old, **EXACT, msg=lambda m: f"{name}: {m}")


# -- 4. frozen parameters and adapters ---------------------------------------------------------------


def test_frozen_parameters_in_a_resident_slice_and_freezing_between_steps():
    """A bias frozen from the start in the resident first slice; a resident weight and a streamed
    one frozen between steps, the resident one trained again later: as the plain optimizer."""
    plain, model = network(), resident_model(network(), 2)
    for m in (plain, model):
        m.get_submodule("0").bias.requires_grad_(False)  # frozen from the start, in the resident first slice
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(5):
        if step == 2:  # freeze a resident weight and a streamed one between steps
            for m in (plain, model):
                m.get_submodule("2").weight.requires_grad_(False)
                m.get_submodule("5").weight.requires_grad_(False)
        if step == 4:
            for m in (plain, model):
                m.get_submodule("2").weight.requires_grad_(True)
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            loss_of(m, step).backward()
            opt.step()
            opt.zero_grad()
    assert model.get_submodule("0").bias.grad is None
    assert_same(plain, plain_opt, model, optimizer)


def test_lora_on_resident_slices_trains_like_the_peft_model():
    """PEFT LoRA on a Llama whose first slice (embedding, first layer and its adapters) is
    resident, the frozen base beside trained adapters: logits, loss and adapter gradients as the
    PeftModel's own, and its weights after two steps of AdamW."""
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from offload.integrations.transformers import causal_lm_sequential

    from .test_peft import assert_same_step, lora, trainable
    from .test_transformers import batch as lm_batch
    from .test_transformers import build

    peft_model = lora(build("llama", dropout=0.1, layers=2), "llama")
    reference = copy.deepcopy(peft_model)
    model = OffloadModel(causal_lm_sequential(peft_model), device="cpu", num_slices=3, resident_slices=1)
    adapters = [[e.tensor for e in s.storage.held if e.tensor.requires_grad] for s in model._engine.slices]
    assert adapters[0] and adapters[1], "adapters in the resident first slice and in a streamed one"
    plain_opt = torch.optim.AdamW(trainable(reference), lr=1e-2)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad],
                                 lr=1e-2)
    inputs = lm_batch()
    for step in range(2):  # the second after an update of the resident adapters
        assert_same_step(peft_model, reference, model, inputs, seed=step)
        for opt in (plain_opt, optimizer):
            opt.step()
            opt.zero_grad()
    optimizer.synchronize()
    for (name, p), q in zip(peft_model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{name}: {m}")


# -- 5. a Hugging Face causal LM through the integration ---------------------------------------------


def test_a_hugging_face_causal_lm_with_resident_slices_trains_like_the_model():
    """``OffloadedCausalLM(hf, resident_slices=1)``: the keyword reaches OffloadModel; the tied
    embedding is resident and the head borrows it; losses and weights as the model's own."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from offload.integrations.transformers import OffloadedCausalLM

    from .test_transformers import batch as lm_batch
    from .test_transformers import build
    from .test_peft import labels_of

    hf = build("llama", dropout=0.0, tied=True)
    reference = copy.deepcopy(hf)
    model = OffloadedCausalLM(hf, device="cpu", num_slices=3, resident_slices=1)
    assert model.offloaded.resident_slices == 1
    plain_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optimizer = OffloadOptimizer(model.offloaded, torch.optim.AdamW, lr=1e-2)
    inputs = lm_batch()
    labels = labels_of(inputs)
    for step in range(3):
        want = reference(**inputs, labels=labels, use_cache=False).loss
        got = model(**inputs, labels=labels).loss
        torch.testing.assert_close(got, want, **EXACT)
        want.backward()
        got.backward()
        for opt in (plain_opt, optimizer):
            opt.step()
            opt.zero_grad()
    optimizer.synchronize()
    for (name, p), q in zip(reference.named_parameters(), hf.parameters()):
        torch.testing.assert_close(q, p, **EXACT, msg=lambda m: f"{name}: {m}")


def test_the_trainer_trains_a_causal_lm_with_resident_slices_like_the_plain_model(tmp_path):
    """``transformers.Trainer`` (accumulation, clipping, warm-up, evaluation) with the optimizer of
    ``offload_optimizer``: every logged loss and gradient norm and every weight, bit for bit."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from offload.integrations.transformers import OffloadedCausalLM

    from .test_trainer import EVAL, TRAIN, arguments, assert_same_weights, llama, logged

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        plain = llama()
        trainer = transformers.Trainer(model=plain, args=arguments(tmp_path / "plain"), train_dataset=TRAIN,
                                       eval_dataset=EVAL)
        trainer.train()
        hf = llama()
        model = OffloadedCausalLM(hf, device="cpu", num_slices=3, resident_slices=1)
        args = arguments(tmp_path / "offloaded")
        offloaded = transformers.Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                                         optimizers=(model.offload_optimizer(args), None))
        offloaded.train()
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert logged(offloaded) == logged(trainer)
    assert_same_weights(hf, plain)


def test_accelerate_trains_saves_and_resumes_a_resident_model_like_the_plain_model(tmp_path):
    """Accelerate's ``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``, ``save_state`` (by
    a model with one resident slice), ``load_state`` (into one with two) and ``save_model``."""
    pytest.importorskip("accelerate")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from .test_accelerate import BATCHES, accelerator, train
    from .test_save_libraries import _scramble, assert_same_state, layers

    acc = accelerator()
    plain = layers()
    plain, plain_opt = acc.prepare(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    train(acc, plain, plain_opt, BATCHES)
    want = {name: value.clone() for name, value in plain.state_dict().items()}

    def prepared(resident: int, perturb: bool) -> tuple[Any, OffloadModel, Any]:
        layers_ = layers()
        if perturb:  # what the resume must overwrite
            layers_.apply(_scramble)
        model = OffloadModel(layers_, device="cpu", num_slices=3, resident_slices=resident)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
        acc = accelerator()
        return (acc, *acc.prepare(model, optimizer))

    acc, model, optimizer = prepared(1, perturb=False)
    train(acc, model, optimizer, BATCHES[:4])
    acc.save_state(tmp_path / "state")
    acc, model, optimizer = prepared(2, perturb=True)
    acc.load_state(tmp_path / "state")
    train(acc, model, optimizer, BATCHES[4:])
    assert_same_state(model.state_dict(), want)
    acc.save_model(model, tmp_path / "model")
    assert_same_state(safetensors_torch.load_file(tmp_path / "model" / "model.safetensors"), want)


def test_load_causal_lm_fills_resident_slices(tmp_path):
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from offload.integrations.transformers import causal_lm_sequential, load_causal_lm

    from .test_transformers import batch as lm_batch
    from .test_transformers import build

    hf = build("llama", dropout=0.0)
    hf.save_pretrained(tmp_path)
    model, _ = load_causal_lm(tmp_path, "cpu", num_slices=3, resident_slices=2)
    streamed = OffloadModel(causal_lm_sequential(copy.deepcopy(hf)), device="cpu", num_slices=3)
    assert model.resident_slices == 2
    for (name, p), q in zip(streamed.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, **EXACT, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(model(lm_batch()), streamed(lm_batch()), **EXACT)


def test_a_trained_causal_lm_with_resident_slices_saves_and_loads_back(tmp_path):
    """``save_pretrained`` of an OffloadedCausalLM whose embedding (tied to the head) and first
    layer are resident, loaded back by ``from_pretrained`` with other resident counts and by
    ``transformers`` itself: the same logits."""
    transformers = pytest.importorskip("transformers")
    from offload.integrations.transformers import OffloadedCausalLM

    from .test_transformers import batch as lm_batch
    from .test_transformers import build
    from .test_peft import labels_of

    model = OffloadedCausalLM(build("llama", dropout=0.0, tied=True), device="cpu", num_slices=3, resident_slices=2)
    optimizer = OffloadOptimizer(model.offloaded, torch.optim.AdamW, lr=1e-2)
    inputs = lm_batch()
    model(**inputs, labels=labels_of(inputs)).loss.backward()
    optimizer.step()
    optimizer.synchronize()
    model.eval()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        want = model(**inputs).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(plain(**inputs, use_cache=False).logits, want, **EXACT)
        for resident in (0, 3):
            loaded = OffloadedCausalLM.from_pretrained(tmp_path, "cpu", num_slices=3, resident_slices=resident).eval()
            assert loaded.offloaded.resident_slices == resident
            torch.testing.assert_close(loaded(**inputs).logits, want, **EXACT)


# -- 6. moves, state dicts, loading -----------------------------------------------------------------


def test_state_dict_keys_storage_and_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    plain, model = network(), resident_model(network(), 2)
    assert list(model.state_dict()) == list(plain.state_dict())
    storages = [t.untyped_storage().data_ptr() for t in model.state_dict().values()]
    assert len(set(storages)) == len(storages), "resident tensors share storage"
    safetensors_torch.save_file(model.state_dict(), tmp_path / "model.safetensors")
    loaded = safetensors_torch.load_file(tmp_path / "model.safetensors")
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(loaded[name], value, **EXACT)


@pytest.mark.parametrize("resident", [1, 3])
def test_state_dict_tensors_share_storage_where_the_plain_models_do(resident):
    """A tied embedding held by a resident slice: its two keys share one storage, as on the plain
    model, and no other two tensors do."""
    from .test_tied import network as tied_network

    def sharing(state: dict[str, torch.Tensor]) -> list[list[str]]:
        groups: dict[int, list[str]] = {}
        for name, value in state.items():
            groups.setdefault(value.untyped_storage().data_ptr(), []).append(name)
        return sorted(groups.values())

    plain = tied_network(dropout=0.0)
    model = OffloadModel(tied_network(dropout=0.0), device="cpu", num_slices=3, resident_slices=resident)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert sharing(model.state_dict()) == sharing(plain.state_dict())
    assert any(len(group) == 2 for group in sharing(plain.state_dict()))


def test_load_state_dict_into_a_resident_model_then_train():
    plain, model = network(), resident_model(network(seed=5), 2)
    model.load_state_dict(plain.state_dict())
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    train_both(plain, plain_opt, model, optimizer)
    # And between steps, after state exists: the loaded values are what the next forward uses.
    fresh = network(seed=7)
    plain.load_state_dict(fresh.state_dict())
    model.load_state_dict(fresh.state_dict())
    train_both(plain, plain_opt, model, optimizer)
    assert_same(plain, plain_opt, model, optimizer)


def test_load_sequential_fills_resident_slices(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    plain = network()
    safetensors_torch.save_file(plain.state_dict(), tmp_path / "model.safetensors")
    model = offload.load_sequential(network, tmp_path / "model.safetensors", "cpu", num_slices=NUM_SLICES,
                                    resident_slices=2)
    assert model.resident_slices == 2
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    train_both(plain, plain_opt, model, optimizer)
    assert_same(plain, plain_opt, model, optimizer)


@pytest.mark.parametrize("convert", ["double", "to-float64", "half-then-float"])
def test_dtype_conversions_of_a_resident_model(convert):
    plain, model = network(), resident_model(network(), 2)
    if convert == "half-then-float":
        plain.half().float()
        model.half().float()
    elif convert == "double":
        plain.double()
        model.double()
    else:
        plain.to(torch.float64)
        model.to(torch.float64)
    dtype = next(plain.parameters()).dtype
    assert all(p.dtype == dtype for p in model.parameters())
    x = batch(0).to(dtype)
    torch.testing.assert_close(model(x), plain(x), **EXACT)
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(2):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            m(batch(step).to(dtype)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_same(plain, plain_opt, model, optimizer)


def test_a_move_to_the_same_device_keeps_the_resident_slices():
    plain, model = network(), resident_model(network(), 2)
    model.to("cpu")
    model.cpu()
    assert model.resident_slices == 2
    plain_opt = plain_optimizer(torch.optim.AdamW, plain.parameters(), {"lr": 1e-2})
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    train_both(plain, plain_opt, model, optimizer)
    assert_same(plain, plain_opt, model, optimizer)


@CUDA
def test_load_sequential_fills_resident_slices_on_a_gpu(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    plain = network()
    safetensors_torch.save_file(plain.state_dict(), tmp_path / "model.safetensors")
    model = offload.load_sequential(network, tmp_path / "model.safetensors", "cuda", num_slices=NUM_SLICES,
                                    resident_slices=2)
    assert next(model.parameters()).device.type == "cuda"
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.cpu(), p, **EXACT, msg=lambda m: f"{name}: {m}")


# -- 7. masters and optimizer state on disk ---------------------------------------------------------


def test_masters_on_disk_with_resident_slices(tmp_path):
    """Float32 masters in files and optimizer state on disk, the first two slices resident: their
    masters and state stay on the device, the others' go to the files; the same bits as the model
    streaming every slice with the same tiers."""

    def build(resident: int) -> tuple[OffloadModel, OffloadOptimizer]:
        model = resident_model(network(), resident, compute_dtype=torch.bfloat16,
                               masters=DiskTier(tmp_path / f"masters{resident}"))
        return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True,
                                       disk_tier=DiskTier(tmp_path / f"state{resident}"))

    (reference, reference_opt), (model, optimizer) = build(0), build(2)
    with reference_opt, optimizer:
        for step in range(3):
            for m, opt in ((reference, reference_opt), (model, optimizer)):
                loss_of(m, step).backward()
                opt.step()
                opt.zero_grad()
        assert_same(reference, reference_opt, model, optimizer)
        assert [s.storage.masters_file is None for s in model._engine.slices] == [True, True, False, False]
        assert sorted(optimizer._tier.records) == [2, 3]
        footprint = model.memory_footprint()
        assert footprint.device_resident == sum(
            e.tensor.numel() * e.tensor.element_size() for s in model._engine.slices[:2] for e in s.storage.held)


@pytest.mark.parametrize("saved, loaded", [(1, 3), (3, 0), (0, 2), (4, 1)])
def test_checkpoints_move_between_resident_counts(saved, loaded, tmp_path):
    """A checkpoint written by a model with ``saved`` resident slices (masters and optimizer state
    on disk for the others) resumes bit for bit in one with ``loaded``: the files do not depend on
    where the slices lived."""
    count = iter(range(100))

    def build(resident: int) -> tuple[OffloadModel, OffloadOptimizer]:
        n = next(count)
        model = resident_model(network(), resident, compute_dtype=torch.bfloat16, masters=DiskTier(tmp_path / f"m{n}"))
        return model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True,
                                       disk_tier=DiskTier(tmp_path / f"s{n}"))

    def train(m: OffloadModel, opt: OffloadOptimizer, steps: range) -> None:
        for step in steps:
            loss_of(m, step).backward()
            opt.step()
            opt.zero_grad()

    straight, straight_opt = build(0)
    train(straight, straight_opt, range(4))
    first, first_opt = build(saved)
    train(first, first_opt, range(2))
    offload.save_checkpoint(tmp_path / "ckpt", first, first_opt)
    resumed, resumed_opt = build(loaded)
    offload.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    train(resumed, resumed_opt, range(2, 4))
    assert_same(straight, straight_opt, resumed, resumed_opt)


# -- 8. sparse gradients -----------------------------------------------------------------------------


def sparse_network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Flatten(), nn.Linear(40, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_sparse_embedding_gradients_in_a_resident_slice(num_microbatches):
    models = [OffloadModel(sparse_network(), device="cpu", num_slices=3, num_microbatches=num_microbatches,
                           resident_slices=k) for k in (0, 1)]
    plain = sparse_network()
    optimizers = [plain_optimizer(torch.optim.SGD, m.parameters(), {"lr": 0.1}) for m in (plain, *models)]
    for step in range(3):
        ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(step))
        for m, opt in zip((plain, *models), optimizers):
            for _ in range(2):  # accumulated: the second adds into the first's sparse .grad
                m(ids).pow(2).mean().backward()
        grads = [m.get_submodule("0").weight.grad for m in (plain, *models)]
        assert all(g.is_sparse for g in grads)
        torch.testing.assert_close(grads[2].to_dense(), grads[1].to_dense(), **EXACT)
        if num_microbatches == 1:
            torch.testing.assert_close(grads[2].to_dense(), grads[0].to_dense(), **EXACT)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 1)  # zeroed in place: the next backward adds into it
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, **EXACT)


@pytest.mark.parametrize("resident", [0, 1])
def test_the_footprint_counts_sparse_gradients(resident):
    """``memory_footprint()`` with a sparse embedding gradient (its indices and values) on the
    host or, resident, on the device: counted where it is, not a crash."""
    model = OffloadModel(sparse_network(), device="cpu", num_slices=3, resident_slices=resident)
    ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(0))
    model(ids).pow(2).mean().backward()
    grad = model.get_submodule("0").weight.grad
    assert grad.is_sparse
    footprint = model.memory_footprint()
    sparse_bytes = grad._indices().untyped_storage().nbytes() + grad._values().untyped_storage().nbytes()
    dense = [p.grad for p in model.parameters() if not p.grad.is_sparse]
    dense_bytes = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in dense}
    if resident:
        assert footprint.device_resident_gradients == sparse_bytes
        assert footprint.host_gradients == sum(dense_bytes.values())
    else:
        assert footprint.device_resident_gradients == 0
        assert footprint.host_gradients >= sum(dense_bytes.values()) + grad._values().nbytes


# -- 9. the stream scenarios with resident slices: faults, and under the checker ---------------------


def build_resident(layers: Any, resident: int, **kwargs: Any) -> OffloadModel:
    return OffloadModel(layers, device="cpu", resident_slices=resident, **kwargs)


#: Scenarios of tests/stream_scenarios.py that suit resident slices (no process group), with how many
#: slices to keep on the device (each builds at least two slices).
RESIDENT_SCENARIOS = {
    "faults": 2,  # a failure mid-forward and mid-backward in a resident slice (the fourth layer: slice 1)
    "faults_offloaded": 2,
    "frozen_first_slice": 1,
    "sparse_gradients_and_strided_boundaries": 1,
    "tied_across_slices_offload_optimizer": 1,
    "offload_optimizer_masters_on_disk": 1,
    "offload_optimizer_disk_tier": 1,
    "offloaded_activations": 2,
    "forward_then_host_writes": 1,
    "reads_between_step_and_forward": 1,
    "two_forwards_one_backward": 1,
    "retain_graph_twice": 1,
    "update_in_backward": 1,
}


def failures_in_the_first_slice(build: Any, set_to_none: bool, num_microbatches: int) -> list[torch.Tensor]:
    """A failure in forward and one in backward in the first slice, after the later slices (resident
    ones among them) added their gradients into ``.grad`` zeroed in place or left to autograd;
    then training on. What ``.grad`` holds after each failure is part of the result."""
    torch.manual_seed(0)
    counter, faulty = stream_scenarios.Counter(8), stream_scenarios.Faulty(8)
    slices = [nn.Sequential(counter, faulty, nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
              nn.Sequential(stream_scenarios.Counter(8), nn.Linear(8, 8)), nn.Sequential(nn.Tanh(), nn.Linear(8, 3))]
    model = build(slices, num_microbatches=num_microbatches)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    seen: list[torch.Tensor] = []
    for step in range(4):
        optimizer.zero_grad(set_to_none=set_to_none)
        if step in (1, 2):
            arm = "fail_forward" if step == 1 else "fail_backward"
            setattr(faulty, arm, True)
            with pytest.raises(stream_scenarios.Fault):
                model(stream_scenarios.inputs(step)).pow(2).sum().backward()
            setattr(faulty, arm, False)
            seen += [p.grad.clone() if p.grad is not None else torch.full((1,), -1.0) for p in model.parameters()]
        model(stream_scenarios.inputs(step)).pow(2).sum().backward()
        seen += [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return seen + stream_scenarios.state(model)


@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("resident", [1, 3])
def test_failures_in_a_resident_slice_then_training_on(resident, set_to_none, num_microbatches):
    expected = failures_in_the_first_slice(functools.partial(build_resident, resident=0), set_to_none,
                                           num_microbatches)
    got = failures_in_the_first_slice(functools.partial(build_resident, resident=resident), set_to_none,
                                      num_microbatches)
    assert same(expected, got)
    with StreamChecker(schedule="late", seed=7) as checker:
        checked = failures_in_the_first_slice(functools.partial(build_resident, resident=resident), set_to_none,
                                              num_microbatches)
    assert not checker.races, checker.summary()
    assert same(expected, checked)


def tied_after_buffers(build: Any, compute_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """An embedding held by the resident first slice and borrowed by the last, which takes the
    slot the second slice (BatchNorm: buffers written back from the slot) used, its borrowed copy
    laid over the bytes of that slice's buffers."""
    torch.manual_seed(0)
    table = nn.Embedding(11, 8)
    slices = [nn.Sequential(stream_scenarios._Lookup(table), nn.Linear(8, 8)),
              nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
              nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), stream_scenarios.Unembed(table))]
    model = build(slices, compute_dtype=compute_dtype)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    return stream_scenarios.train(model, steps=3, optimizer=optimizer)


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_weight_borrowed_from_a_resident_slice_after_buffers_is_exact(compute_dtype):
    expected = tied_after_buffers(functools.partial(build_resident, resident=0), compute_dtype)
    assert same(expected, tied_after_buffers(functools.partial(build_resident, resident=1), compute_dtype))


def test_a_weight_borrowed_from_a_resident_slice_waits_for_the_slots_write_back():
    with StreamChecker(schedule="late", seed=7) as checker:
        stream_scenarios.resident_tied_after_buffers(build_resident_on_cpu)
    assert not checker.races, checker.summary()


def build_resident_on_cpu(layers: Any, **kwargs: Any) -> OffloadModel:
    return OffloadModel(layers, device="cpu", **kwargs)


def run_scenario(name: str, resident: int) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "OffloadModel with num_microbatches > 1 runs BatchNorm")
        return stream_scenarios.SCENARIOS[name](functools.partial(build_resident, resident=resident))


def same(expected: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    return len(expected) == len(got) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("name", sorted(RESIDENT_SCENARIOS))
def test_scenarios_with_resident_slices_are_exact(name):
    assert same(run_scenario(name, 0), run_scenario(name, RESIDENT_SCENARIOS[name])), \
        "resident slices changed the results"


@pytest.mark.parametrize("name", sorted(RESIDENT_SCENARIOS))
def test_scenarios_with_resident_slices_are_race_free(name):
    expected = run_scenario(name, 0)
    with StreamChecker(schedule="late", seed=7) as checker:
        checked = run_scenario(name, RESIDENT_SCENARIOS[name])
    assert not checker.races, checker.summary()
    assert same(expected, checked), "deferred copies changed the results"


def test_zeroing_resident_and_host_gradients_in_place_is_not_reported():
    with StreamChecker(schedule="late", seed=7) as checker:
        run_scenario("reads_between_step_and_forward", 1)
    assert not checker.races, checker.summary()
