"""Several models in one process: parameters that two OffloadModels hold (a submodule two
nn.Sequentials share, one nn.Sequential wrapped twice, an OffloadModel used as a layer of another,
one Hugging Face model in two OffloadedCausalLMs), trained by an OffloadOptimizer while the other
model runs between its steps, bit for bit as the plain models with torch.optim (Note: [Parameters
several models hold] in offload/walk/engine.py); and a GAN's discriminator under
``update_in_backward`` (docs/optimizer.md, Several models in one loop)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

EXACT = {"rtol": 0.0, "atol": 0.0}


class SlowSGD(torch.optim.SGD):
    """SGD that waits a moment before each step: on an OffloadOptimizer's worker, the update is still
    pending when the other model's forward comes, as a real model's update is."""

    def step(self, closure=None):
        time.sleep(0.05)
        return super().step(closure)


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(step))


def shared_submodule() -> tuple[nn.Module, nn.Module]:
    """Two nn.Sequentials over one nn.Embedding."""
    embedding = nn.Embedding(10, 4)
    return (nn.Sequential(embedding, nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)),
            nn.Sequential(embedding, nn.Linear(4, 2)))


def one_sequential() -> tuple[nn.Module, nn.Module]:
    """The same nn.Sequential, wrapped twice (into other slices)."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, model


def nested() -> tuple[nn.Module, nn.Module]:
    """An nn.Sequential whose middle layer is the other model."""
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    return nn.Sequential(nn.Embedding(10, 4), inner, nn.Linear(4, 2)), inner


FORMS = {"shared_submodule": (shared_submodule, (2, 2)), "one_sequential": (one_sequential, (3, 2)),
         "nested": (nested, (3, 2))}


def models(form: str, **settings) -> tuple[tuple[nn.Module, nn.Module], tuple[OffloadModel, OffloadModel]]:
    """The plain pair of ``form`` and an offloaded twin that shares its parameters the same way
    (one deep copy of the pair keeps what the two share shared)."""
    build, (trained_slices, other_slices) = FORMS[form]
    torch.manual_seed(0)
    plain = build()
    trained, other = copy.deepcopy(plain)
    if form == "nested":
        other = OffloadModel(other, device="cpu", num_slices=other_slices, **settings)
        trained[1] = other
        return plain, (OffloadModel(trained, device="cpu", num_slices=trained_slices, **settings), other)
    return plain, (OffloadModel(trained, device="cpu", num_slices=trained_slices, **settings),
                   OffloadModel(other, device="cpu", num_slices=other_slices, **settings))


def other_input(form: str, step: int) -> torch.Tensor:
    if form == "nested":
        return torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(100 + step))
    return ids(100 + step)


def assert_same_parameters(actual: nn.Module, expected: nn.Module) -> None:
    for (name, a), b in zip(actual.named_parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("update_in_backward", [False, True])
def test_the_other_model_runs_while_an_update_is_pending(form, update_in_backward):
    """The other model's forward right after ``step()``, its update pending on the worker: it sees
    the updated parameter, and the update is kept. It read the parameter before the update landed
    and laid it out into its own host buffer, so the update wrote the buffer it had left, and was
    lost for good."""
    (plain, plain_other), (model, other) = models(form)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    optimizer = OffloadOptimizer(model, SlowSGD, lr=0.1, momentum=0.9, update_in_backward=update_in_backward)
    for step in range(4):
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            m(ids(step)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(other(other_input(form, step)), plain_other(other_input(form, step)), **EXACT)
    optimizer.synchronize()
    assert_same_parameters(model, plain)


@pytest.mark.parametrize("masters", ["ram", "disk"])
def test_under_a_compute_dtype_the_other_model_reads_the_updated_masters(masters, tmp_path):
    """Under a compute dtype the host copy is the float32 master the update writes (its shadow cast
    from it): the other model reads it after the update, as it does after ``synchronize()``, and
    the trained model's parameters are those of a run where the other model never ran."""
    settings = {"compute_dtype": torch.bfloat16, "masters": None if masters == "ram" else str(tmp_path)}
    runs = []
    for evaluated in ("after synchronize()", "right after step()", None):
        _, (model, other) = models("shared_submodule", **settings)
        optimizer = OffloadOptimizer(model, SlowSGD, lr=0.1, momentum=0.9)
        outputs = []
        for step in range(3):
            model(ids(step)).float().pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if evaluated == "after synchronize()":
                optimizer.synchronize()
            if evaluated is not None:
                with torch.no_grad():
                    outputs.append(other(ids(100 + step)))
        optimizer.synchronize()
        runs.append((outputs, [p.detach().clone() for p in model.parameters()]))
    (synchronized, reference), (pending, parameters), (_, alone) = runs
    for a, b in zip(pending, synchronized):
        torch.testing.assert_close(a, b, **EXACT)
    for a, b, c in zip(parameters, reference, alone):
        torch.testing.assert_close(a, b, **EXACT)
        torch.testing.assert_close(a, c, **EXACT)


@pytest.mark.parametrize("stepped_by", ["torch.optim", "OffloadOptimizer", "OffloadOptimizer in backward"])
def test_two_models_each_with_its_optimizer_over_one_embedding(stepped_by):
    """Each model stepped by its own optimizer in turn, the embedding by both: with torch.optim over
    the offloaded parameters (exact before), and with an OffloadOptimizer each, whose updates of
    the embedding are both pending when the other model's forward lays it out again."""
    (plain_a, plain_b), (a, b) = models("shared_submodule")
    plain_opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (plain_a, plain_b)]
    if stepped_by == "torch.optim":
        opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (a, b)]
    else:
        in_backward = stepped_by.endswith("in backward")
        opts = [OffloadOptimizer(m, torch.optim.Adam, lr=0.1, update_in_backward=in_backward) for m in (a, b)]
    for step in range(3):
        for models_, optimizers in (((plain_a, plain_b), plain_opts), ((a, b), opts)):
            for m, opt in zip(models_, optimizers):
                m(ids(step)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    for opt in opts:
        getattr(opt, "synchronize", lambda: None)()
    assert_same_parameters(a, plain_a)
    assert_same_parameters(b, plain_b)


def test_a_model_wrapped_while_an_update_of_its_parameters_is_pending():
    """Wrapping the nn.Sequential again right after ``step()`` lays its parameters out once the
    update has landed (the advice of the refusal to wrap an OffloadModel: wrap the original
    nn.Sequential again); both wrappers then run with the trained values."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    layers = copy.deepcopy(plain)
    model = OffloadModel(layers, device="cpu", num_slices=3)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    optimizer = OffloadOptimizer(model, SlowSGD, lr=0.1)
    for m, opt in ((plain, plain_opt), (model, optimizer)):
        m(ids(0)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    again = OffloadModel(layers, device="cpu", num_slices=2)  # the update still pending
    for step in range(1, 3):
        with torch.no_grad():
            torch.testing.assert_close(again(ids(100 + step)), plain(ids(100 + step)), **EXACT)
        for m, opt in ((plain, plain_opt), (model, optimizer)):
            m(ids(step)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    optimizer.synchronize()
    assert_same_parameters(model, plain)


def test_one_hugging_face_model_in_two_causal_lms():
    """One Hugging Face model wrapped twice: the one trained by its OffloadOptimizer, the other
    evaluated right after each ``step()``; both the plain model's, bit for bit."""
    pytest.importorskip("transformers")
    from offload.integrations.causal_lm import OffloadedCausalLM

    from .test_transformers import batch, build

    hf = build("llama", dropout=0.0, layers=2)
    plain = copy.deepcopy(hf)
    lm = OffloadedCausalLM(hf, device="cpu", num_slices=2)
    evaluated = OffloadedCausalLM(hf, device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(lm, SlowSGD, lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    inputs = batch()
    labels = inputs["input_ids"].clone()
    for _ in range(3):
        for m, opt in ((plain, plain_opt), (lm, optimizer)):
            m(**inputs, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(evaluated(**inputs, labels=labels).loss, plain(**inputs, labels=labels).loss,
                                       **EXACT)
    optimizer.synchronize()
    for a, b in zip(hf.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, **EXACT)


def gan(offloaded: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
    discriminator = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    if not offloaded:
        return generator, discriminator
    return (OffloadModel(generator, device="cpu", num_slices=2),
            OffloadModel(discriminator, device="cpu", num_slices=2))


def gan_step(generator, discriminator, g_opt, d_opt, step: int, switch_off: bool) -> None:
    """One step of each, the discriminator's first; ``switch_off``: its parameters require no grad
    for the generator's step."""
    g = torch.Generator().manual_seed(step)
    real, z = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    bce = nn.BCEWithLogitsLoss()
    fake = generator(z)
    for p in discriminator.parameters():
        p.requires_grad_(True)
    d_opt.zero_grad()
    bce(discriminator(torch.cat([real, fake.detach()])), torch.cat([torch.ones(8, 1), torch.zeros(8, 1)])).backward()
    d_opt.step()
    for p in discriminator.parameters():
        p.requires_grad_(not switch_off)
    g_opt.zero_grad()
    bce(discriminator(fake), torch.ones(8, 1)).backward()
    g_opt.step()


def test_a_gan_whose_discriminator_updates_in_backward():
    """The generator's backward goes through the discriminator D: while D's parameters require
    grad, it is D's accumulation-ending backward and starts D's update with the generator loss's
    gradients. D's next ``zero_grad()`` refuses, naming that cause and the switch that avoids it;
    with D's parameters switched off for the generator's step, both step as the plain optimizers."""
    generator, discriminator = gan(offloaded=True)
    g_opt = OffloadOptimizer(generator, torch.optim.Adam, lr=1e-2)
    d_opt = OffloadOptimizer(discriminator, torch.optim.Adam, lr=1e-2, update_in_backward=True)
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) without step\(\).*backward through this model for another "
                                           r"model's loss.*requires_grad_\(False\)"):
        for step in range(2):
            gan_step(generator, discriminator, g_opt, d_opt, step, switch_off=False)

    # Without D's zero_grad() before its next backward, its step() counts one backward too many, and
    # says the same.
    generator, discriminator = gan(offloaded=True)
    d_opt = OffloadOptimizer(discriminator, torch.optim.Adam, lr=1e-2, update_in_backward=True)
    with pytest.raises(RuntimeError, match=r"step\(\) after 2 backward\(s\).*backward through this model for another "
                                           r"model's loss.*requires_grad_\(False\)"):
        for step in range(2):
            fake = generator(torch.randn(8, 4, generator=torch.Generator().manual_seed(step)))
            discriminator(fake.detach()).pow(2).mean().backward()
            d_opt.step()
            discriminator(fake).mean().backward()  # the generator's loss, through D

    plain = gan(offloaded=False)
    offloaded = gan(offloaded=True)
    optimizers = [[torch.optim.Adam(m.parameters(), lr=1e-2) for m in plain],
                  [OffloadOptimizer(offloaded[0], torch.optim.Adam, lr=1e-2),
                   OffloadOptimizer(offloaded[1], torch.optim.Adam, lr=1e-2, update_in_backward=True)]]
    for step in range(4):
        for models_, (g_opt, d_opt) in zip((plain, offloaded), optimizers):
            gan_step(*models_, g_opt, d_opt, step, switch_off=True)
    for opt in optimizers[1]:
        opt.synchronize()
    assert optimizers[1][1]._in_backward.last_started == {0, 1}
    for a, b in zip(offloaded, plain):
        assert_same_parameters(a, b)
