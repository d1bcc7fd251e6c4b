"""Checks a built one-pass kernel against PyTorch's fused Adam/AdamW on this machine before it is
used: every option the kernel takes, sizes around the vector width, non-finite values. Bits must
agree (NaN payloads aside); a kernel that differs in one element is not used."""

from __future__ import annotations

from types import ModuleType

import torch

from .one_pass import adam_one_pass


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])
                and torch.equal(torch.signbit(a[~nan_a]), torch.signbit(b[~nan_b])))


def check_against_torch(kernel: ModuleType) -> str | None:
    """``None`` when the kernel and a cast give PyTorch's bits in every probe, else what differed."""
    generator = torch.Generator().manual_seed(0)
    width = kernel.vector_size()
    sizes = [1, width - 1, width, width + 3, 5 * width + 7, 1031]
    base = dict(adamw=True, amsgrad=False, maximize=False, weight_decay=0.0, beta1=0.9, scale=None, dtype=torch.bfloat16)
    changes = [{}, {"amsgrad": True}, {"maximize": True}, {"weight_decay": 0.05}, {"beta1": 0.3},
               {"scale": 128.0}, {"dtype": torch.float16}, {"amsgrad": True, "maximize": True, "weight_decay": 0.05}]
    cases = [{**base, **change, "adamw": adamw} for adamw in (True, False) for change in changes]
    for number, case in enumerate(cases):
        adamw, amsgrad, maximize = case["adamw"], case["amsgrad"], case["maximize"]
        weight_decay, beta1, scale, dtype = case["weight_decay"], case["beta1"], case["scale"], case["dtype"]

        def make(spread: float) -> list[torch.Tensor]:
            return [torch.randn(n, generator=generator) * spread for n in sizes]

        params, grads, exp_avgs = make(3.0), make(1.0), make(0.1)
        exp_avg_sqs = [t.abs() for t in make(0.01)]
        maxes = [t * 1.5 for t in exp_avg_sqs] if amsgrad else []
        grads[-1][::97] = float("nan")
        grads[-1][1::89] = float("inf")
        params[-1][::50] = float("-inf")
        params[-2][::3] = 3e38
        steps = [torch.tensor(float(1 + number % 5)) for _ in sizes]
        options = dict(lr=1e-3 if number % 2 else 0.1, beta1=beta1, beta2=0.999 if number % 2 else 0.95,
                       weight_decay=weight_decay, eps=1e-8, amsgrad=amsgrad, maximize=maximize,
                       grad_scale=None if scale is None else torch.tensor(scale))
        expected = [[t.clone() for t in group] for group in (params, grads, exp_avgs, exp_avg_sqs, maxes)]
        (torch._fused_adamw_ if adamw else torch._fused_adam_)(*expected, steps, **options)
        shadows = [torch.empty(n, dtype=dtype) for n in sizes]
        adam_one_pass(kernel, [params, grads, exp_avgs, exp_avg_sqs, maxes, steps], shadows, adamw, options)
        got = [params, grads, exp_avgs, exp_avg_sqs, maxes]
        for name, mine, theirs in zip(("parameter", "gradient", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), got, expected):
            for k, (a, b) in enumerate(zip(mine, theirs)):
                if not _same(a, b):
                    return f"{name} of {sizes[k]} elements, adamw={adamw} amsgrad={amsgrad} maximize={maximize}"
        for k, (shadow, param) in enumerate(zip(shadows, expected[0])):
            if not _same(shadow.float(), param.to(dtype).float()):
                return f"{dtype} shadow of {sizes[k]} elements"
    return None
