"""Checks built one-pass kernels against PyTorch's fused Adam, AdamW and SGD on this machine before
they are used: every option the kernels take, sizes around the vector width, non-finite values.
Bits must agree (NaN payloads aside); kernels that differ in one element are not used."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from .one_pass import one_pass

_aten = torch.ops.aten


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, signs of zeros included; NaN where the other has NaN."""
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])
                and torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan])))


def adam_cases() -> Iterator[tuple[Any, dict[str, Any], torch.dtype]]:
    """(kernel, options, shadow dtype): each option of Adam and AdamW changed on its own, and together."""
    base = {"lr": 0.1, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False,
            "maximize": False, "grad_scale": None}
    changes: list[dict[str, Any]] = [{}, {"amsgrad": True}, {"maximize": True}, {"weight_decay": 0.05}, {"beta1": 0.3},
                                     {"grad_scale": torch.tensor(128.0)}, {"lr": 1e-3, "beta2": 0.999},
                                     {"amsgrad": True, "maximize": True, "weight_decay": 0.05}]
    for op in (_aten._fused_adamw_.default, _aten._fused_adam_.default):
        for number, change in enumerate(changes):
            yield op, {**base, **change}, torch.float16 if number == 2 else torch.bfloat16


def sgd_cases() -> Iterator[tuple[Any, dict[str, Any], torch.dtype]]:
    """(kernel, options, shadow dtype) of SGD: with and without momentum, its first step and later ones."""
    base = {"weight_decay": 0.0, "momentum": 0.9, "lr": 0.1, "dampening": 0.0, "nesterov": False, "maximize": False,
            "is_first_step": False, "grad_scale": None}
    changes: list[dict[str, Any]] = [{}, {"momentum": 0.0}, {"is_first_step": True}, {"nesterov": True},
                                     {"weight_decay": 0.05, "dampening": 0.1}, {"maximize": True},
                                     {"grad_scale": torch.tensor(64.0)}]
    for number, change in enumerate(changes):
        yield _aten._fused_sgd_.default, {**base, **change}, torch.float16 if number == 3 else torch.bfloat16


def inputs(op: Any, options: dict[str, Any], sizes: list[int], generator: torch.Generator) -> list[list[torch.Tensor]]:
    """Arguments of ``op`` over tensors of ``sizes``, with infinities, NaN and values near the
    largest float in the last ones."""
    def make(spread: float) -> list[torch.Tensor]:
        return [torch.randn(n, generator=generator) * spread for n in sizes]

    params, grads = make(3.0), make(1.0)
    grads[-1][::97] = float("nan")
    grads[-1][1::89] = float("inf")
    params[-1][::50] = float("-inf")
    params[-2][::3] = 3e38
    if op == _aten._fused_sgd_.default:
        return [params, grads, make(0.1) if options["momentum"] else []]
    exp_avg_sqs = [t.abs() for t in make(0.01)]
    return [params, grads, make(0.1), exp_avg_sqs, [t * 1.5 for t in exp_avg_sqs] if options["amsgrad"] else [],
            [torch.tensor(3.0) for _ in sizes]]


def check_against_torch(kernel: ModuleType) -> str | None:
    """``None`` when the kernels and a cast give PyTorch's bits in every probe, else what differed."""
    generator = torch.Generator().manual_seed(0)
    width = kernel.vector_size()
    sizes = [1, width - 1, width, 2 * width, width + 3, 5 * width + 7, 1031]
    # Each case as the update runs it, and with a clip's coefficient multiplied into the gradients
    # first (clip_grads_with_norm_'s grad.mul_ before the step), with a shadow and without one.
    clipped = torch.tensor(0.3712)
    cases = [(op, options, shadow, clip) for op, options, dtype in [*adam_cases(), *sgd_cases()]
             for shadow, clip in ((dtype, None), (dtype, clipped), (None, clipped))]
    for op, options, dtype, clip in cases:
        given = inputs(op, options, sizes, generator)
        expected = [[t.clone() for t in group] for group in given]
        if clip is not None:
            for grad in expected[1]:
                grad.mul_(clip)
        op(*expected, **options)
        shadows = [torch.empty(n if dtype is not None else 0, dtype=dtype or torch.bfloat16) for n in sizes]
        one_pass(kernel, op, given, shadows, options, clip)
        what = f"{options}{'' if clip is None else f', clipped by {clip.item()}'}"
        for number, (mine, theirs) in enumerate(zip(given, expected)):
            for k, (a, b) in enumerate(zip(mine, theirs)):
                if not same_bits(a, b):
                    return f"{op.__name__} argument {number} ({'parameter' if number == 0 else 'state'}), {sizes[k]} elements, {what}"
        for k, (shadow, param) in enumerate(zip(shadows, expected[0])):
            if dtype is not None and not same_bits(shadow.float(), param.to(dtype).float()):
                return f"{op.__name__}: {dtype} shadow of {sizes[k]} elements, {what}"
    return None
