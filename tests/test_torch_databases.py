"""PyTorch's own test databases as a standing outside check: every layer of ``module_db`` and every
optimizer setting of ``optim_db`` through OffloadModel, bit for bit against the plain module.

Modules (``torch.testing._internal.common_modules.module_db``): each module is built from its
first sample input (:data:`INPUTS_PER_MODULE`) (a deterministic subset, to bound CI time), in
float32 and float64, in training mode, and wrapped as ``nn.Sequential(Call(module), Identity())``
(``Call`` adapts a multi-argument forward: the model input is the tuple of positional
arguments). Each runs as:

- its inputs as given, on one slice, and on two slices with checkpointing (the module's outputs
  cross a boundary and the module is recomputed in backward) and without;
- with strided inputs (``x.repeat_interleave(2, -1)[..., ::2]``, ``TestModule``'s recipe), and
  ``channels_last`` (``channels_last_3d``) where an input is 4-D (5-D), on two checkpointed
  slices;
- with two microbatches where the inputs are batched (the tensors cut along dim 0 have at least
  two dims) and the outputs can be joined (see :func:`joinable`), against the
  plain module run on the same chunks (OffloadModel's documented semantics, so a layer that
  couples the rows, BatchNorm, is compared too).

Outputs, input gradients, parameter gradients and buffers are compared with
``assert_close(rtol=0, atol=0)``. Modules that cannot be compared are listed in
:data:`EXCLUDED` with the reason, those whose dim 0 is no batch in :data:`NOT_MICROBATCHED`;
none is skipped silently.

Optimizers (``torch.testing._internal.common_optimizers.optim_db``): every CPU setting of
``optim_inputs_func`` steps a small model three times, through :class:`~offload.OffloadOptimizer`
and through the plain optimizer on an OffloadModel, against the plain optimizer on the plain
model; parameters must match bit for bit.
"""

from __future__ import annotations

import copy
import sys
import types
import unittest
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload import OffloadModel, OffloadOptimizer

try:
    import expecttest  # noqa: F401
except ImportError:
    # PyTorch's test internals import expecttest only for the base class of their own TestCase,
    # which nothing here uses; the ``test`` extra installs it (pyproject.toml).
    _shim = types.ModuleType("expecttest")
    _shim.TestCase = unittest.TestCase  # type: ignore[attr-defined]
    sys.modules["expecttest"] = _shim

_flags_were_mutable = getattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)
from torch.testing._internal.common_modules import module_db  # noqa: E402
from torch.testing._internal.common_optimizers import optim_db  # noqa: E402

# Importing PyTorch's test utilities freezes torch.backends flags for the whole session; the rest
# of the suite is not PyTorch's test suite.
setattr(torch.backends, "__allow_nonbracketed_mutation_flag", _flags_were_mutable)

EXACT = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}  # NaN where the plain module gives NaN
INPUTS_PER_MODULE = 1
DTYPES = [torch.float32, torch.float64]

#: Modules left out, each with the reason.
EXCLUDED: dict[str, str] = {
    **{f"nn.Lazy{kind}": "lazy: its parameters do not exist until the first forward, so there is nothing to offload"
       for kind in ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")},
}


#: Modules whose sample inputs do not carry the batch along dim 0, so that cutting dim 0 into
#: microbatches changes what the module is asked (OffloadModel cuts dim 0 of every input that
#: has the first input's size there): they run without microbatches only.
NOT_MICROBATCHED: dict[str, str] = {
    "nn.CTCLoss": "dim 0 of log_probs is time: halving it makes the input lengths invalid",
    "nn.MultiheadAttention": "batch_first=False: dim 0 is the target sequence, and the attention weights (batch, "
                             "target, source) cannot be joined along it",
}


class Call(nn.Module):
    """Calls ``module`` with the model input, ``(args, kwargs)``, as its arguments: a sample's
    keyword tensors (``nn.Linear``'s ``input=``) enter through the model's input like the
    positional ones, so that their gradients are compared too (held by this layer, they would be
    tensors the walk cannot differentiate: Note: [Leaves outside the slice])."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = inputs
        return self.module(*args, **kwargs)


def strided(x: torch.Tensor) -> torch.Tensor:
    return x.repeat_interleave(2, -1)[..., ::2]


def channels_last(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if x.dim() == 5:
        return x.contiguous(memory_format=torch.channels_last_3d)
    return x


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _fresh_inputs(args: tuple[Any, ...], layout: Callable[[torch.Tensor], torch.Tensor] | None
                  ) -> tuple[tuple[Any, ...], list[torch.Tensor]]:
    """The forward arguments with every floating tensor a new leaf (its grad compared), then laid
    out by ``layout``."""
    leaves, spec = tree_flatten(args)
    grad_leaves: list[torch.Tensor] = []
    fed = []
    for x in leaves:
        if _floating(x):
            leaf = x.detach().clone().requires_grad_(x.requires_grad)
            if leaf.requires_grad:
                grad_leaves.append(leaf)
            fed.append(layout(leaf) if layout is not None and x.dim() > 0 else leaf)
        elif isinstance(x, torch.Tensor):
            fed.append(x.clone())
        else:
            fed.append(x)
    return tree_unflatten(fed, spec), grad_leaves


def _output_grads(output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs = [o for o in tree_flatten(output)[0] if _floating(o) and o.requires_grad]
    generator = torch.Generator().manual_seed(3)
    grads = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in outs]
    return outs, grads


def _run(model: nn.Module, args: tuple[Any, ...], layout: Callable | None, seed: int = 0
         ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Forward and backward; the flattened outputs and the input gradients."""
    fed, grad_leaves = _fresh_inputs(args, layout)
    torch.manual_seed(seed)
    output = model(fed)
    outs, grads = _output_grads(output)
    if outs:
        torch.autograd.backward(outs, grads)
    flat = [o.detach() if isinstance(o, torch.Tensor) else o for o in tree_flatten(output)[0]]
    return flat, [leaf.grad for leaf in grad_leaves]


def _run_in_chunks(plain: nn.Module, args: tuple[Any, ...], chunks: int
                   ) -> tuple[list[Any], list[torch.Tensor | None]] | None:
    """What OffloadModel computes with microbatches, on the plain module: each chunk in turn; or
    ``None`` where the chunks' outputs cannot be joined (see :func:`joinable`)."""
    fed, grad_leaves = _fresh_inputs(args, None)
    leaves, spec = tree_flatten(fed)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0 or tensors[0].shape[0] < chunks:
        return None
    rows = tensors[0].shape[0]
    if any(x.dim() < 2 for x in tensors if x.dim() > 0 and x.shape[0] == rows):
        return None  # an unbatched input (features only): dim 0 is no batch
    outputs, sizes = [], []
    torch.manual_seed(0)
    for k in range(chunks):
        part = [torch.tensor_split(x, chunks)[k] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == rows
                else x for x in leaves]
        sizes.append(torch.tensor_split(tensors[0], chunks)[k].shape[0])
        outputs.append(tree_flatten(plain(tree_unflatten(part, spec)))[0])
    if not joinable(outputs, sizes):
        return None
    # Each chunk's backward with its rows of the whole output's gradient.
    whole = [torch.cat(parts) for parts in zip(*[[o for o in out if _floating(o) and o.requires_grad]
                                                 for out in outputs])]
    _, grads = _output_grads(whole)
    for k, out in enumerate(outputs):
        outs = [o for o in out if _floating(o) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.tensor_split(g, chunks)[k] for g in grads])
    joined = [torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0] for parts in zip(*outputs)]
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in joined], [leaf.grad for leaf in grad_leaves]


def joinable(outputs: list[list[Any]], sizes: list[int]) -> bool:
    """Whether OffloadModel can join the chunks' outputs: every tensor output of every chunk
    carries the chunk's rows along dim 0 (a loss's scalar, an RNN's final state do not)."""
    return any(isinstance(o, torch.Tensor) for o in outputs[0]) and all(
        not isinstance(o, torch.Tensor) or (o.dim() > 0 and o.shape[0] == n)
        for out, n in zip(outputs, sizes) for o in out)


def _assert_same(got: list[Any], want: list[Any], what: str) -> None:
    assert len(got) == len(want), what
    for k, (a, b) in enumerate(zip(got, want)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{what} {k}"
            torch.testing.assert_close(a, b, **EXACT, msg=lambda m: f"{what} {k}: {m}")
        else:
            assert a == b or (a is None and b is None), f"{what} {k}"


def _assert_state(model: OffloadModel, plain: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=lambda m: f"grad of {name}: {m}")
    for (name, b), c in zip(model.named_buffers(), plain.buffers()):
        torch.testing.assert_close(b, c, **EXACT, msg=lambda m: f"buffer {name}: {m}")


def _variants(args: tuple[Any, ...]) -> list[tuple[str, Callable | None, int, bool]]:
    """Layout, slices and checkpointing of each run: the input as given on one slice and on two
    (checkpointed or not); strided and ``channels_last`` on two checkpointed slices, where the
    module's outputs cross a boundary and its recompute must see the forward's layout."""
    runs: list[tuple[str, Callable | None, int, bool]] = [
        ("as given", None, 1, True), ("as given", None, 2, True), ("as given", None, 2, False),
        ("strided", strided, 2, True)]
    if any(isinstance(x, torch.Tensor) and x.dim() in (4, 5) for x in tree_flatten(args)[0]):
        runs.append(("channels_last", channels_last, 2, True))
    return runs


def _module_cases() -> list[Any]:
    cases = []
    for info in module_db:
        if info.name in EXCLUDED:
            continue
        for dtype in DTYPES:
            if dtype in info.dtypes:
                cases.append(pytest.param(info, dtype, id=f"{info.name}-{str(dtype).removeprefix('torch.')}"))
    return cases


def test_every_module_is_run_or_listed():
    names = {info.name for info in module_db}
    assert set(EXCLUDED) <= names, f"listed but not in module_db: {sorted(set(EXCLUDED) - names)}"
    assert set(NOT_MICROBATCHED) <= names - set(EXCLUDED)
    run = {case.values[0].name for case in _module_cases()}
    assert names == run | set(EXCLUDED)


@pytest.mark.parametrize(("info", "dtype"), _module_cases())
def test_module_db(info, dtype):
    samples = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=True)
    ran = 0
    for sample in samples[:INPUTS_PER_MODULE]:
        if sample.forward_input is None:
            continue
        cargs, ckwargs = sample.constructor_input.args, sample.constructor_input.kwargs
        args = (tuple(sample.forward_input.args), dict(sample.forward_input.kwargs))
        torch.manual_seed(0)
        module = info.module_cls(*cargs, **ckwargs).to(dtype).train()
        plain_base = nn.Sequential(Call(module), nn.Identity())
        for layout_name, layout, num_slices, checkpoint in _variants(args):
            what = f"{layout_name}, {num_slices} slices, checkpoint {checkpoint}"
            plain = copy.deepcopy(plain_base)
            model = OffloadModel(copy.deepcopy(plain_base), device="cpu", num_slices=num_slices,
                                 checkpoint_activation=checkpoint)
            want_out, want_in = _run(plain, args, layout)
            got_out, got_in = _run(model, args, layout)
            _assert_same(got_out, want_out, f"output ({what})")
            _assert_same(got_in, want_in, f"input grad ({what})")
            _assert_state(model, plain)
        # Microbatches: OffloadModel runs each slice on the chunks in turn, so the plain module
        # on the same chunks is the reference, batch-coupled layers (BatchNorm) included.
        plain = copy.deepcopy(plain_base)
        reference = None if info.name in NOT_MICROBATCHED else _run_in_chunks(plain, args, 2)
        if reference is not None:
            model = OffloadModel(copy.deepcopy(plain_base), device="cpu", num_slices=2, num_microbatches=2)
            got_out, got_in = _run(model, args, None)
            _assert_same(got_out, reference[0], "output (2 microbatches)")
            _assert_same(got_in, reference[1], "input grad (2 microbatches)")
            _assert_state(model, plain)
        ran += 1
    assert ran, "no sample input ran"


# -- optimizers -----------------------------------------------------------------------------------

#: Optimizer settings left out of the OffloadOptimizer comparison, with the reason.
NOT_THROUGH_OFFLOAD_OPTIMIZER: dict[str, str] = {
    "LBFGS": "its step() re-evaluates the model through a closure, which a step on a host worker beside the next "
             "forward cannot run; OffloadOptimizer refuses it at construction (tests/test_optimizer.py). The plain "
             "LBFGS on an OffloadModel is compared below.",
}

STEPS = 3


def _optimizer_model(info: Any) -> nn.Sequential:
    torch.manual_seed(0)
    if info.only_supports_sparse_grads:  # SparseAdam: an embedding with sparse gradients
        return nn.Sequential(nn.Embedding(10, 5, sparse=True), nn.Tanh(), nn.Linear(5, 3))
    # Muon steps matrices only: no biases.
    bias = info.optim_cls.__name__ != "Muon"
    return nn.Sequential(nn.Linear(5, 6, bias=bias), nn.Tanh(), nn.Linear(6, 6, bias=bias), nn.Tanh(),
                         nn.Linear(6, 3, bias=bias))


def _optimizer_params(info: Any, model: nn.Module) -> list[nn.Parameter]:
    if info.only_supports_sparse_grads:
        return [p for name, p in model.named_parameters() if name.startswith("0.")]
    return list(model.parameters())


def _optimizer_batch(info: Any, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 + step)
    if info.only_supports_sparse_grads:
        return torch.randint(0, 10, (4, 3), generator=generator)
    return torch.randn(4, 5, generator=generator)


def _train(info: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for step in range(STEPS):
        x = _optimizer_batch(info, step)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss
        if info.step_requires_closure:
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()


def _optim_cases() -> list[Any]:
    cases = []
    for info in optim_db:
        for setting in info.optim_inputs_func(device="cpu"):
            name = info.optim_cls.__name__
            cases.append(pytest.param(info, setting, id=f"{name}-{setting.desc}"))
    return cases


@pytest.mark.parametrize("through", ["OffloadOptimizer", "torch.optim"])
@pytest.mark.parametrize(("info", "setting"), _optim_cases())
def test_optim_db(info, setting, through):
    name = info.optim_cls.__name__
    if through == "OffloadOptimizer" and name in NOT_THROUGH_OFFLOAD_OPTIMIZER:
        with pytest.raises(ValueError, match="closure"):
            OffloadOptimizer(OffloadModel(_optimizer_model(info), device="cpu", num_slices=2), info.optim_cls,
                             **copy.deepcopy(setting.kwargs))
        return
    plain = _optimizer_model(info)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    reference = info.optim_cls(_optimizer_params(info, plain), **copy.deepcopy(setting.kwargs))
    if through == "OffloadOptimizer":
        optimizer = OffloadOptimizer(model, info.optim_cls, _optimizer_params(info, model),
                                     **copy.deepcopy(setting.kwargs))
    else:
        optimizer = info.optim_cls(_optimizer_params(info, model), **copy.deepcopy(setting.kwargs))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "is stepping OffloadModel's host parameters")
        _train(info, plain, reference)
        _train(info, model, optimizer)
    if isinstance(optimizer, OffloadOptimizer):
        optimizer.synchronize()
    for (param_name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{param_name}: {m}")
