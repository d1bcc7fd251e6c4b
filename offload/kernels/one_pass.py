"""The one-pass host update: while a slice's optimizer steps, PyTorch's fused Adam/AdamW kernel is
replaced, for the parameters that have a shadow, by one that also writes the shadow.

Note: [One-pass update]
    Under a compute dtype, a slice's host update used to be two passes over its float32 masters:
    the optimizer's (AdamW reads and writes the masters and both moments and reads the gradient:
    28 bytes a parameter) and then a cast of every master into the bfloat16 shadow that the next
    load copies (4 bytes read again, 2 written: 6 more, about a fifth of the update). The one-pass
    kernel (``adam_shadow.cpp``) stores the shadow from the value it has just computed, while it
    is still in a register: 30 bytes instead of 34.

    Nothing else changes. The user's optimizer class still runs, with its own arguments, state and
    step counting; only its call of ``torch._fused_adam_``/``torch._fused_adamw_`` is served
    differently, by :class:`OnePassUpdate`, a dispatch mode active on the update worker's thread
    for that slice's step. The kernel repeats PyTorch's arithmetic operation for operation, over
    PyTorch's own vector type and with the flags of its CPU capability, on each tensor's whole
    vectors; the elements after a tensor's last whole vector, and any tensor the kernel does not
    take (no shadow, not contiguous), go to PyTorch's kernel in the same call's place, and their
    shadow is cast after. So the masters, the moments and the shadow are bit for bit what
    ``fused=True`` and a cast give (``check.py`` proves it on this machine before first use;
    tests/test_one_pass.py across the options). Only the fused path is served: the per-tensor and
    ``foreach`` implementations, other optimizers, ``lr`` as a tensor and a GradScaler step that
    found an inf keep the two passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
#: The fused kernels served, and whether each decouples the weight decay (AdamW).
FUSED_ADAM = {_aten._fused_adamw_.default: True, _aten._fused_adam_.default: False}


def adam_one_pass(kernel: ModuleType, lists: Sequence[list[torch.Tensor]], shadows: list[torch.Tensor],
                  adamw: bool, options: dict[str, Any]) -> None:
    """Step ``lists`` (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, as
    PyTorch's fused kernel takes them; every tensor float32, contiguous, on the CPU) as
    ``torch._fused_adamw_`` (``adamw``) or ``torch._fused_adam_`` with ``options`` would, and cast
    each parameter into ``shadows`` (same sizes, bfloat16 or float16) after."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
    amsgrad = options["amsgrad"]
    kernel.adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, shadows, options["lr"],
                     options["beta1"], options["beta2"], options["weight_decay"], options["eps"], amsgrad,
                     options["maximize"], adamw, options.get("grad_scale"))
    # What is left after each tensor's last whole vector: PyTorch's own scalar loop.
    width = kernel.vector_size()
    tails = [k for k, p in enumerate(params) if p.numel() % width]
    if not tails:
        return
    start = {k: params[k].numel() - params[k].numel() % width for k in tails}

    def cut(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [tensors[k].view(-1)[start[k]:] for k in tails]

    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    fused(cut(params), cut(grads), cut(exp_avgs), cut(exp_avg_sqs), cut(max_exp_avg_sqs) if amsgrad else [],
          [steps[k] for k in tails], **options)
    for k in tails:
        shadows[k].view(-1)[start[k]:].copy_(params[k].view(-1)[start[k]:])


class OnePassUpdate(TorchDispatchMode):
    """Serves the fused Adam/AdamW kernel for the parameters in ``shadow_of`` (a host copy's
    address to its shadow view) with :func:`adam_one_pass`; ``written`` collects the addresses
    whose shadow it wrote. Active on one thread, for one slice's optimizer step."""

    def __init__(self, kernel: ModuleType, shadow_of: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.kernel = kernel
        self.shadow_of = shadow_of
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in FUSED_ADAM or not self._serve(func, args, kwargs):
            return func(*args, **kwargs)
        return None

    def _serve(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Run ``func``'s call with the one-pass kernel where it can; ``False`` to run it as it is."""
        lists = [list(a) for a in args]
        while len(lists) < 6:
            lists.append([])
        options = dict(kwargs)
        found_inf = options.pop("found_inf", None)
        if found_inf is not None:
            if found_inf.item() != 0:
                return False  # PyTorch's kernel skips the step: nothing to write
        grad_scale = options.get("grad_scale")
        if grad_scale is not None and (grad_scale.device.type != "cpu" or grad_scale.dtype != torch.float32):
            return False
        mine = [k for k, p in enumerate(lists[0]) if self._takes(k, lists, options["amsgrad"])]
        if not mine:
            return False
        pick = lambda tensors, ks: [tensors[k] for k in ks]  # noqa: E731
        amsgrad = options["amsgrad"]
        chosen = [pick(t, mine) if (i != 4 or amsgrad) else [] for i, t in enumerate(lists)]
        adam_one_pass(self.kernel, chosen, [self.shadow_of[lists[0][k].data_ptr()] for k in mine],
                      FUSED_ADAM[func], options)
        self.written.update(lists[0][k].data_ptr() for k in mine)
        rest = [k for k in range(len(lists[0])) if k not in set(mine)]
        if rest:
            func(*[pick(t, rest) if (i != 4 or amsgrad) else [] for i, t in enumerate(lists)], **kwargs)
        return True

    def _takes(self, k: int, lists: list[list[torch.Tensor]], amsgrad: bool) -> bool:
        param = lists[0][k]
        shadow = self.shadow_of.get(param.data_ptr())
        if shadow is None or shadow.numel() != param.numel():
            return False
        tensors = [lists[i][k] for i in (0, 1, 2, 3)] + ([lists[4][k]] if amsgrad else [])
        return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                   and t.numel() == param.numel() for t in tensors)
