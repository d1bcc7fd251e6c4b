"""The one-pass host update: while a slice's optimizer steps, PyTorch's fused Adam, AdamW and SGD
kernels are replaced, for the parameters that have a shadow, by ones that also write the shadow.

Note: [One-pass update]
    Under a compute dtype, a slice's host update used to be two passes over its float32 masters:
    the optimizer's (AdamW reads and writes the masters and both moments and reads the gradient:
    28 bytes a parameter) and then a cast of every master into the bfloat16 shadow that the next
    load copies (4 bytes read again, 2 written: 6 more, about a fifth of the update). The one-pass
    kernels (``one_pass.cpp``) store the shadow from the value they have just computed, while it
    is still in a register: 30 bytes instead of 34 for AdamW, 18 instead of 22 for SGD with momentum.

    Nothing else changes. The user's optimizer class still runs, with its own arguments, state and
    step counting; only its call of ``torch._fused_adam_``, ``torch._fused_adamw_`` or
    ``torch._fused_sgd_`` is served differently, by :class:`OnePassUpdate`, a dispatch mode active
    on the update worker's thread for that slice's step. The kernels repeat PyTorch's arithmetic
    operation for operation, over PyTorch's own vector type and with the flags of its CPU
    capability, on each tensor's whole vectors; the elements after a tensor's last whole vector,
    and any tensor they do not take (no shadow, not contiguous), go to PyTorch's kernel in the same
    call's place, and their shadow is cast after. So parameters, state and shadow are bit for bit
    what ``fused=True`` and a cast give (``check.py`` proves it on this machine before first use;
    tests/test_one_pass.py across the options). Only the fused implementations are served: the
    per-tensor and ``foreach`` ones, other optimizers, ``lr`` as a tensor and a GradScaler step that
    found an inf keep the two passes.

    The same pass also does a clip's multiplication of the gradients when ``clip_grad_norm_`` left
    it to the update (Note: [Scaling in the update] in ``offload/optimizing/deferred_scaling.py``):
    each gradient is multiplied by the coefficient as it is read, and stored back so.

    The kernels let go of Python's lock while they run, as PyTorch's do: a slice's update takes
    milliseconds to tens of them, and the thread that drives the device launches every kernel of
    the forward and backward from Python beside it (held, it stopped that thread for each slice's
    update: ``benchmarks/stream_idle.py``'s pauses in the H200 trace of 2026-11-28).

    A kernel call is C++ that no dispatch mode sees, where PyTorch's kernel it stands in for is an
    operator every mode sees. So that a mode below :class:`OnePassUpdate` (the stream-ordering
    checker's, which checks every host update's reads and writes against the copies in flight)
    still sees what the update touches, each call is announced first by ``offload::kernel_accesses``,
    an operator that does nothing and whose schema marks as written what the kernel writes: what
    PyTorch's kernel's schema marks so, and the shadows. It is called only where such a mode is
    active, and moves no version counter (neither does the kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .scaling import OwedScaling

_aten = torch.ops.aten

# An operator that touches nothing, to show dispatch modes what a kernel call reads and writes (Note:
# [One-pass update], last paragraph). Defined without an ADInplaceOrView kernel: no version counter moves.
_library = torch.library.Library("offload", "FRAGMENT")
_library.define("kernel_accesses(Tensor[] read, Tensor(a!)[] written) -> ()")
_library.impl("kernel_accesses", lambda read, written: None, "CompositeExplicitAutograd")


@dataclass(frozen=True)
class Served:
    """How one of PyTorch's fused kernels takes its arguments, and the one-pass kernel's call."""

    lists: int  # positional lists it takes
    per_element: tuple[int, ...]  # those with a tensor of the parameter's size (or empty, when unused)
    run: Callable[[ModuleType, list[list[torch.Tensor]], list[torch.Tensor], dict[str, Any], float | None], None]


def _adam(adamw: bool) -> Callable[..., None]:
    def run(kernel: ModuleType, lists: list[list[torch.Tensor]], shadows: list[torch.Tensor], o: dict[str, Any],
            clip: float | None) -> None:
        kernel.adam_step(*lists, shadows, o["lr"], o["beta1"], o["beta2"], o["weight_decay"], o["eps"], o["amsgrad"],
                         o["maximize"], adamw, o.get("grad_scale"), clip)
    return run


def _sgd(kernel: ModuleType, lists: list[list[torch.Tensor]], shadows: list[torch.Tensor], o: dict[str, Any],
         clip: float | None) -> None:
    kernel.sgd_step(*lists, shadows, o["weight_decay"], o["momentum"], o["lr"], o["dampening"], o["nesterov"],
                    o["maximize"], o["is_first_step"], o.get("grad_scale"), clip)


#: The fused kernels served: params, grads, state lists (and Adam's steps, one per parameter).
SERVED = {
    _aten._fused_adamw_.default: Served(6, (0, 1, 2, 3, 4), _adam(True)),
    _aten._fused_adam_.default: Served(6, (0, 1, 2, 3, 4), _adam(False)),
    _aten._fused_sgd_.default: Served(3, (0, 1, 2), _sgd),
}


def one_pass(kernel: ModuleType, op: Any, lists: Sequence[list[torch.Tensor]], shadows: list[torch.Tensor],
             options: dict[str, Any], clip: torch.Tensor | None = None) -> None:
    """Step ``lists`` as PyTorch's fused kernel ``op`` would with ``options`` (every tensor float32,
    contiguous, on the CPU), and cast each parameter into ``shadows`` (same sizes, bfloat16 or
    float16; an empty tensor for none) from its new value. With ``clip`` (a 0-d float32
    coefficient), the gradients are first multiplied by it, as ``grad.mul_(clip)`` would, in the
    same pass."""
    served = SERVED[op]
    lists = [list(group) for group in lists]
    if torch._C._len_torch_dispatch_stack():
        _announce(op, lists, shadows, options)
    served.run(kernel, lists, shadows, options, None if clip is None else float(clip.item()))
    # What is left after each tensor's last whole vector: PyTorch's own scalar loop.
    width = kernel.vector_size()
    params = lists[0]
    tails = [k for k, p in enumerate(params) if p.numel() % width]
    if not tails:
        return
    start = {k: params[k].numel() - params[k].numel() % width for k in tails}
    cut = [[group[k].view(-1)[start[k]:] if i in served.per_element else group[k] for k in tails] if group else []
           for i, group in enumerate(lists)]
    if clip is not None:
        for grad in cut[1]:
            grad.mul_(clip)
    op(*cut, **options)
    for k in tails:
        if shadows[k].numel():
            shadows[k].view(-1)[start[k]:].copy_(params[k].view(-1)[start[k]:])


def _announce(op: Any, lists: Sequence[list[torch.Tensor]], shadows: list[torch.Tensor],
              options: dict[str, Any]) -> None:
    """Show the dispatch modes active what the kernel standing in for ``op`` is about to read and
    write (Note: [One-pass update], last paragraph)."""
    read: list[torch.Tensor] = []
    written = [shadow for shadow in shadows if shadow.numel()]
    for argument, group in zip(op._schema.arguments, lists):
        (written if argument.alias_info is not None and argument.alias_info.is_write else read).extend(group)
    if isinstance(options.get("grad_scale"), torch.Tensor):
        read.append(options["grad_scale"])
    torch.ops.offload.kernel_accesses(read, written)


#: The kernel's "no shadow" (a parameter it steps only to multiply its owed gradient as it reads it).
_NO_SHADOW = torch.empty(0, dtype=torch.bfloat16)

#: Operations that take a tensor's size, not its values (fused SGD's first step makes its momentum
#: buffers like the gradients): an owed gradient they take stays owed.
_READS_NO_VALUES = {_aten.empty_like.default, _aten.zeros_like.default}


class OnePassUpdate(TorchDispatchMode):
    """Serves PyTorch's fused optimizer kernels for the parameters in ``shadow_of`` (a host copy's
    address to its shadow view) with :func:`one_pass`; ``written`` collects the addresses whose
    shadow it wrote. Active on one thread, for one slice's optimizer step.

    With ``scaling``, a clip's product still owed on some gradients: the kernel multiplies those it
    steps as it reads them (a parameter without a shadow too, for that alone); any other operation
    that reads one gets it multiplied first."""

    def __init__(self, kernel: ModuleType, shadow_of: dict[int, torch.Tensor],
                 scaling: OwedScaling | None = None) -> None:
        super().__init__()
        self.kernel = kernel
        self.shadow_of = shadow_of
        self.scaling = scaling
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in SERVED and self._serve(func, args, kwargs):
            return None
        if self.scaling is not None and func not in _READS_NO_VALUES:
            self.scaling.apply(tree_leaves((args, kwargs)))
        return func(*args, **kwargs)

    def _serve(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Run ``func``'s call with the one-pass kernel where it can; ``False`` to run it as it is."""
        served = SERVED[func]
        lists = [list(a) for a in args] + [[] for _ in range(served.lists - len(args))]
        options = dict(kwargs)
        found_inf = options.pop("found_inf", None)
        if found_inf is not None and found_inf.item() != 0:
            return False  # PyTorch's kernel skips the step: nothing to write
        grad_scale = options.get("grad_scale")
        if grad_scale is not None and (grad_scale.device.type != "cpu" or grad_scale.dtype != torch.float32):
            return False
        mine = [k for k in range(len(lists[0])) if self._takes(k, lists, served)]
        if not mine:
            return False

        def pick(ks: list[int]) -> list[list[torch.Tensor]]:
            return [[group[k] for k in ks] if group else [] for group in lists]

        grads, clip = [lists[1][k] for k in mine], None
        if self.scaling is not None:
            if self.scaling.folds(grads):
                clip = self.scaling.coefficient
            else:
                self.scaling.apply(grads)
        shadows = [self.shadow_of.get(lists[0][k].data_ptr(), _NO_SHADOW) for k in mine]
        one_pass(self.kernel, func, pick(mine), shadows, options, clip)
        if self.scaling is not None:
            self.scaling.taken(grads)
        self.written.update(lists[0][k].data_ptr() for k in mine if lists[0][k].data_ptr() in self.shadow_of)
        rest = sorted(set(range(len(lists[0]))) - set(mine))
        if rest:
            if self.scaling is not None:
                self.scaling.apply(lists[1][k] for k in rest)
            func(*pick(rest), **kwargs)
        return True

    def _takes(self, k: int, lists: list[list[torch.Tensor]], served: Served) -> bool:
        param = lists[0][k]
        shadow = self.shadow_of.get(param.data_ptr())
        if shadow is None:  # no shadow to write: taken only to multiply an owed gradient as it is read
            if self.scaling is None or not self.scaling.owes(lists[1][k]):
                return False
        elif shadow.numel() != param.numel():
            return False
        tensors = [lists[i][k] for i in served.per_element if lists[i]]
        return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                   and t.numel() == param.numel() for t in tensors)
