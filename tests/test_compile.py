"""``torch.compile`` with OffloadModel: compiled layers, and the compiled wrapped model, give the
plain model's results; a compiled layer that writes a buffer in forward is refused by PyTorch, and
the error says why and what to do (docs/api.md, Limitations); the registration hooks OffloadModel
installs leave other compiled modules in one graph, and leave with the last model; compiled layers
compile no more graphs than in the plain model; a compiled ``OffloadOptimizer.step`` is an eager
``torch.optim`` step; a ``loss.backward()`` inside a compiled training step gives the plain model's
gradients; compiled autograd, ``torch.export`` and ``torch.jit.trace`` are refused with
what to do."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from offload import OffloadModel, OffloadOptimizer
from offload.autograd.function import COMPILED_AUTOGRAD
from offload.modeling.compiled import EXPORT_REFUSED
from offload.streams.slice_entries import RegisteredTensors, _RegistrationCounter, collect_entries
from offload.walk.engine import COMPILED_BUFFER_NOTE

EXACT = {"rtol": 0.0, "atol": 0.0}


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _compiled_layers(model: nn.Sequential) -> nn.Sequential:
    return nn.Sequential(*[torch.compile(layer, backend="aot_eager") for layer in model])


@pytest.mark.parametrize("how", ["layers", "wrapped"])
def test_compiled_training_is_the_plain_models(how):
    torch._dynamo.reset()
    plain = network()
    inner = _compiled_layers(copy.deepcopy(plain)) if how == "layers" else copy.deepcopy(plain)
    model = OffloadModel(inner, device="cpu", num_slices=3)
    run = torch.compile(model, backend="aot_eager") if how == "wrapped" else model
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want, got = plain(x), run(x)
        # The walk is skipped as it is, nothing in it traced (Note: [Compiled around the walk]).
        assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message) for w in caught]
        torch.testing.assert_close(got, want, **EXACT)
        want.square().sum().backward()
        got.square().sum().backward()
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, **EXACT, msg=name)
        for o in (plain_opt, opt):
            o.step()
            o.zero_grad()


def test_a_compiled_layer_that_writes_a_buffer_is_refused_with_a_note():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))
    model = OffloadModel(_compiled_layers(layers), device="cpu", num_slices=2)
    assert model.partition[0] == ("0", "1", "2")  # the norm's buffers share the slot with a weight
    with pytest.raises(Exception) as raised:
        model(torch.randn(4, 8))
    assert COMPILED_BUFFER_NOTE in getattr(raised.value, "__notes__", [])


def _counting_backend(graphs: list[torch.fx.GraphModule]):
    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(gm)
        return gm.forward  # the "eager" backend, counted
    return backend


@pytest.mark.parametrize("fullgraph", [False, True])
def test_registration_hooks_leave_compiled_modules_in_one_graph(fullgraph):
    # The registration hooks are process-wide: a hook that read a count made dynamo recompile a
    # spectral-norm layer outside any OffloadModel, which assigns its buffer ``_u`` in forward, at
    # every call (``_RegistrationCounter`` in offload/streams/slice_entries.py says why).
    model = OffloadModel(network(), device="cpu")  # alive: its hooks are installed
    assert _hooks_installed()
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []
    torch.manual_seed(0)
    plain = spectral_norm(nn.Linear(16, 16))
    layer = torch.compile(copy.deepcopy(plain), backend=_counting_backend(graphs), fullgraph=fullgraph)
    for step in range(20):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        torch.testing.assert_close(layer(x), plain(x), **EXACT)
    assert len(graphs) == 1
    del model


def test_a_registration_in_a_compiled_forward_is_still_seen():
    OffloadModel(network(), device="cpu")
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def remember(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        y = layer(x)
        layer.register_buffer("last", y.detach().mean(0))  # a new registration in the layer
        return y

    run = torch.compile(remember, backend=_counting_backend(graphs))
    for _ in range(6):
        layer = nn.Linear(8, 8)
        registered = RegisteredTensors([layer])
        params, buffers = collect_entries([layer])
        run(layer, torch.randn(4, 8))
        # Only the hooks tell: the laid-out entries are all still in place.
        assert registered.changed(params + buffers)
    assert len(graphs) <= 2


def _graphs_for_two_steps(wrap: bool) -> tuple[int, list[torch.Tensor]]:
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []
    layers = nn.Sequential(*[torch.compile(layer, backend=_counting_backend(graphs)) for layer in network()])
    # Three slices, checkpointed: each slice but the last runs forward twice (forward, recompute).
    run = OffloadModel(layers, device="cpu", num_slices=3) if wrap else layers
    results = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        y = run(x)
        y.square().sum().backward()
        results += [y.detach()] + [p.grad.clone() for p in run.parameters()]
        run.zero_grad()
    return len(graphs), results


def test_layers_compiled_before_wrapping_compile_no_more_graphs_than_in_the_plain_model():
    # The checkpointed forward used to flip autocast's cache flag with no autocast on; the flag is
    # in Dynamo's global-state guard, so each compiled layer compiled once more, and six kinds of
    # layer went past Dynamo's recompile limit (8), silently running the rest uncompiled.
    plain_graphs, want = _graphs_for_two_steps(wrap=False)
    wrapped_graphs, got = _graphs_for_two_steps(wrap=True)
    assert wrapped_graphs <= plain_graphs == len(network())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.filterwarnings("ignore:SGD is stepping OffloadModel's host parameters")
def test_layers_compiled_with_inductor_give_the_plain_models_results():
    # Inductor's kernels round unlike eager ones, so a layer that fell back to eager (Dynamo's
    # recompile limit) shows here, where aot_eager's fallback would be bit-identical.
    results = []
    for wrap in (False, True):
        torch._dynamo.reset()
        layers = nn.Sequential(*[torch.compile(layer) for layer in network()])
        run = OffloadModel(layers, device="cpu", num_slices=3) if wrap else layers
        opt = torch.optim.SGD(run.parameters(), lr=0.1)
        results.append([])
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            y = run(x)
            y.square().sum().backward()
            results[-1] += [y.detach()] + [p.grad.clone() for p in run.parameters()]
            opt.step()
            opt.zero_grad()
        results[-1] += [p.detach().clone() for p in run.parameters()]
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, **EXACT)


@pytest.mark.filterwarnings("ignore:.* is stepping OffloadModel's host parameters")
@pytest.mark.parametrize("optimizer_class, kwargs", [(torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9})])
def test_a_compiled_offload_optimizer_step_is_an_eager_torch_optim_step(optimizer_class, kwargs):
    # Dynamo's view of an optimizer sets capturable=True in its groups: AdamW asserted on the host
    # worker (Note: [A compiled step] in offload/optimizing/eager_step.py).
    torch._dynamo.reset()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    plain_opt = optimizer_class(plain.parameters(), lr=0.01, **kwargs)
    opt = OffloadOptimizer(model, optimizer_class, lr=0.01, **kwargs)
    graphs: list[torch.fx.GraphModule] = []
    step = torch.compile(opt.step, backend=_counting_backend(graphs))
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        plain(x).square().sum().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        model(x).square().sum().backward()
        step()
        opt.zero_grad()
    opt.synchronize()
    assert not opt.param_groups[0].get("capturable", False)
    assert not graphs  # nothing of the step was traced
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, **EXACT, msg=name)


def test_a_backward_under_compiled_autograd_is_refused_with_what_to_do():
    # Dynamo used to fail inside the walk's hooks with an internal AttributeError.
    torch._dynamo.reset()
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    x = torch.randn(4, 8)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        with pytest.raises(RuntimeError) as raised:
            model(x).square().sum().backward()
    assert str(raised.value) == COMPILED_AUTOGRAD
    assert all(p.grad is None for p in model.parameters())
    # Outside it, backward is the plain model's.
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **EXACT, msg=name)


@pytest.mark.filterwarnings("ignore:SGD is stepping OffloadModel's host parameters")
@pytest.mark.parametrize("num_slices", [1, 3])
def test_a_backward_inside_a_compiled_training_step_gives_every_gradient_of_the_plain_models(num_slices):
    # loss.backward() in the compiled function is a graph break, with Dynamo's frame hook still on:
    # it traced the walk's backward, and the last slice's parameters (all, with one slice) were left
    # with .grad None, silently (Note: [A backward inside a compiled function] in function.py).
    torch._dynamo.reset()
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=num_slices)

    def train_step(run: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = run(x).square().sum()
        loss.backward()
        return loss

    step = torch.compile(train_step, backend="eager")
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(step(model, x), step(plain, x), **EXACT)
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):
            assert b.grad is not None, name
            torch.testing.assert_close(b.grad, a.grad, **EXACT, msg=name)
        for o in (plain_opt, opt):
            o.step()
            o.zero_grad()


@pytest.mark.filterwarnings("ignore:AdamW is stepping OffloadModel's host parameters")
def test_a_whole_compiled_training_step_with_an_offload_optimizer_is_the_plain_models():
    # Forward, backward, step() and zero_grad() in one compiled function: every parameter differed
    # from the first step on (the last slice never trained); under aot_eager backward raised.
    torch._dynamo.reset()
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    opt = OffloadOptimizer(model, torch.optim.AdamW, lr=0.01)

    @torch.compile(backend="aot_eager")
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        want = plain(x).square().sum()
        want.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        torch.testing.assert_close(train_step(x), want, **EXACT)
    opt.synchronize()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, **EXACT, msg=name)


def _hooks_installed() -> bool:
    registered = _RegistrationCounter._registered
    return all(registered in hooks.values() for hooks in (
        nn.modules.module._global_module_registration_hooks, nn.modules.module._global_parameter_registration_hooks,
        nn.modules.module._global_buffer_registration_hooks))


def test_registration_hooks_leave_with_the_last_model_so_other_models_compile_their_backward():
    # Compiled autograd cannot trace a process-wide registration hook: with one left behind, a plain
    # model's compiled training step failed (KeyError: _orig_mod) once any OffloadModel had been built.
    # In a process of its own: here, models earlier tests left alive keep the hooks installed.
    code = """
import gc, torch
from offload import OffloadModel
from tests.test_compile import _hooks_installed, network
models = [OffloadModel(network(), device="cpu") for _ in range(2)]
assert _hooks_installed()
del models[0]
gc.collect()
assert _hooks_installed()  # the other model still watches
storage = models[0]._engine.slices[-1].storage
storage.layers[0].register_buffer("late", torch.zeros(1))  # and still sees a registration
assert storage.registered_tensors_changed()
del storage, models
gc.collect()
assert not _hooks_installed()
"""
    run_then_compile_a_plain_step(code)


def test_the_hugging_face_cuts_registration_hooks_leave_with_the_last_model_too():
    # The cut's two hooks (_Replacements, rule 5 of Note: [PEFT models]; _CutModels, rule 8) stayed
    # for the rest of the process once an OffloadedCausalLM had been built: a plain model's compiled
    # training step then failed (KeyError: _orig_mod). In a process of its own, as above.
    pytest.importorskip("transformers")
    code = """
import gc, torch
from torch import nn
from offload.integrations.causal_lm import OffloadedCausalLM
from offload.integrations.peft import _CutModels
from offload.integrations.transformers_stages import _Replacements
from tests.test_compile import network
from tests.test_trainer import llama
hooks = nn.modules.module._global_module_registration_hooks.values()
ours = (_Replacements._registered, _CutModels._registered)
for _ in range(2):  # and a model built after the last left installs them again
    models = [OffloadedCausalLM(llama(64), device="cpu", num_slices=2) for _ in range(2)]
    assert all(hook in hooks for hook in ours)
    del models[0]
    gc.collect()
    assert all(hook in hooks for hook in ours)  # the other model still watches
    decoder = models[0].hf_model.model
    try:  # and still refuses a new list of layers (layer_replication)
        decoder.layers = nn.ModuleList(list(decoder.layers))
        raise AssertionError("a new list of layers was not refused")
    except ValueError as refused:
        assert "the decoder's list of layers" in str(refused)
    del models, decoder
    gc.collect()
    assert not any(hook in hooks for hook in ours)
"""
    run_then_compile_a_plain_step(code)


@pytest.mark.parametrize("export", ["non-strict", "strict", "jit.trace"])
def test_exporting_or_tracing_is_refused_with_what_to_do(export):
    torch._dynamo.reset()
    model = OffloadModel(network(), device="cpu", num_slices=3)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError) as raised:
        if export == "jit.trace":
            torch.jit.trace(model, x)
        else:
            torch.export.export(model, (x,), strict=export == "strict")
    assert EXPORT_REFUSED in str(raised.value)
    torch.testing.assert_close(model(x), network()(x), **EXACT)  # and the model runs on


#: Appended to a test's code run in a process of its own: a plain model's training step under
#: compiled autograd, which fails (KeyError: _orig_mod) while a global registration hook is installed.
PLAIN_COMPILED_AUTOGRAD_STEP = """
torch._dynamo.config.compiled_autograd = True
plain = network()

@torch.compile(backend="eager")
def train_step(x):
    loss = plain(x).square().sum()
    loss.backward()
    return loss

train_step(torch.randn(4, 8))
"""


def run_then_compile_a_plain_step(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code + PLAIN_COMPILED_AUTOGRAD_STEP],
                          cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
