"""What a compute dtype refuses in a slice as the slice is laid out: a batch or instance norm in
neither float32 nor the compute dtype, and parameters whose dtype cannot hold the compute dtype's
gradients (Note: [Masters narrower than the compute dtype]). Which device dtype each entry gets is
decided in ``host_storage.py`` (``_set_device_dtypes``), which calls these first; this file holds
only the checks and their messages.

Note: [Masters narrower than the compute dtype]
    Under a compute dtype a parameter's gradient is computed in that dtype and lands in ``.grad``,
    which keeps the parameter's own dtype (PyTorch requires it). Float32 and float64 hold every
    bfloat16 and float16 value, so their gradients are the converted model's exactly
    (docs/mixed-precision.md), and a parameter already in the compute dtype is not cast at all. Any
    other floating-point dtype is *narrower* than the compute dtype: a float16 parameter under
    bfloat16 takes each gradient above 65504 as inf and each below 2**-24 as 0 (one AdamW step
    later the parameter is not finite), a bfloat16 one under float16 rounds them to 8 significant
    bits, silently; and each forward converts its values from one format into the other, which
    rounds or overflows in turn. So:

    1. When the model is wrapped (a slice's first layout), such a parameter is refused with a
       ``ValueError`` naming it, before its slice moves anything. Parameters that keep their dtype
       are not cast and do not count: a batch or instance norm's (in any dtype but float32 and the
       compute dtype, refused by :func:`refuse_norms_in_another_dtype`) and quantized weights
       (``keeping_their_dtype`` in ``host_storage.py``); nor do integer ones.
    2. Frozen parameters (``requires_grad=False``: a base under LoRA) are refused too, though no
       gradient reaches them now: ``requires_grad`` may be switched on after wrapping, which no
       layout sees, and a frozen part converted to the compute dtype before wrapping computes the
       same, bit for bit, in the same bytes, without a cast each forward.
    3. A parameter made narrow after wrapping (``model.half()`` under bfloat16, ``p.data =
       p.data.half()``, an adapter injected in the other dtype) is warned of at the layout that
       follows instead: that conversion may be one step of a round trip (``model.half().float()``),
       which the layout in between cannot tell from one to train in, and a raise would stop
       ``.half()`` half done.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Sequence

import torch
from torch import nn

from .slice_entries import Entry

#: Dtypes that hold every value of either half-precision compute dtype.
_WIDE = (torch.float32, torch.float64)


def refuse_norms_in_another_dtype(norms: Sequence[tuple[str, nn.Module]], compute_dtype: torch.dtype) -> None:
    """Refuse a batch or instance norm of ``norms`` (each with its path in its layer) that holds a
    floating-point tensor in neither float32 nor ``compute_dtype``, with a ``ValueError`` naming it
    (why: ``_set_device_dtypes`` in ``host_storage.py``)."""
    for path, module in norms:
        for name, tensor in [*module.named_parameters(path, recurse=False), *module.named_buffers(path, recurse=False)]:
            if tensor.is_floating_point() and tensor.dtype not in (torch.float32, compute_dtype):
                raise ValueError(
                    f"'{name}' of a {type(module).__name__} is {tensor.dtype}: under compute_dtype={compute_dtype} "
                    "batch and instance norms keep their own dtype, and their kernels take a "
                    f"{compute_dtype} input only with float32 (or {compute_dtype}) weights and running statistics; "
                    "convert them to float32 before wrapping the model (model.float(), or .float() on each norm)"
                )


def refuse_narrow_masters(params: Sequence[Entry], layers: Sequence[nn.Module], kept: Collection[int],
                          compute_dtype: torch.dtype, wrapping: bool) -> None:
    """Refuse the floating-point ``params`` cast to ``compute_dtype`` (all but those whose ids are
    in ``kept``) whose dtype is narrower than it, naming the first ones; after wrapping
    (``wrapping`` false), warn of them instead (Note: [Masters narrower than the compute dtype]).

    Raises:
        ValueError: such a parameter, when ``wrapping``.
    """
    narrow = [entry for entry in params if entry.dtype.is_floating_point and id(entry.tensor) not in kept
              and entry.dtype not in (*_WIDE, compute_dtype)]
    if not narrow:
        return
    dtype = narrow[0].dtype
    same = [entry for entry in narrow if entry.dtype == dtype]
    listed = _names(same[:3], layers) + (f" and {len(same) - 3} more" if len(same) > 3 else "")
    subject = f"parameter {listed} is" if len(same) == 1 else f"parameters {listed} are"
    own = f", or pass compute_dtype={dtype}, the model's own dtype" if dtype in (torch.bfloat16, torch.float16) else ""
    its = "its" if len(same) == 1 else "their"
    why = (f"{its} gradients, computed in {compute_dtype}, would be stored in {its} .grad in {dtype} (a .grad keeps "
           f"its parameter's dtype) and {_losses(dtype, compute_dtype) or 'lose precision'}, silently")
    if forward := _losses(compute_dtype, dtype):  # a float8 parameter converts exactly
        why += f", and each forward would convert {its} values to {compute_dtype} and {forward}: neither can be exact"
    if wrapping:
        raise ValueError(
            f"{subject} {dtype}, under compute_dtype={compute_dtype}: {why}. Convert the model to float32 before "
            f"wrapping it (model.float(): float32 masters, which hold every {compute_dtype} gradient exactly, the "
            f"recommended mixed precision){own}. Frozen parameters count too (requires_grad may be switched on "
            f"later): convert a frozen base to {compute_dtype} before wrapping instead, which computes the same, bit "
            "for bit, without a cast each forward"
        )
    # Not raised: this may be a round trip's first step (rule 3 of the note).
    warnings.warn(
        f"OffloadModel: {subject} now {dtype}, converted after wrapping, under compute_dtype={compute_dtype}: "
        f"{why}. Convert the model back to float32 (model.float()) before the next backward", stacklevel=2)


def _losses(dtype: torch.dtype, compute_dtype: torch.dtype) -> str:
    """How ``dtype`` fails to hold ``compute_dtype``'s values: "overflow to inf above 65504 and
    flush to 0 below 5.96e-08" for float16 and bfloat16; empty where it holds them all."""
    have, need = torch.finfo(dtype), torch.finfo(compute_dtype)
    losses = []
    if have.max < need.max:
        losses.append(f"overflow to inf above {have.max:g}")
    if have.smallest_normal * have.eps > need.smallest_normal * need.eps:  # the smallest subnormals
        losses.append(f"flush to 0 below {have.smallest_normal * have.eps:.3g}")
    if have.eps > need.eps:
        losses.append(f"round to {round(1 - math.log2(have.eps))} significant bits")
    return " and ".join(losses)


def _names(entries: Sequence[Entry], layers: Sequence[nn.Module]) -> str:
    """``'weight', 'bias' of a Linear, 'self_attn.q_proj.weight' of a LlamaDecoderLayer``: each
    parameter from its layer down (its own name alone is often a key), those of one layer together."""
    named: dict[int, tuple[nn.Module, list[str]]] = {}
    for entry in entries:
        site = entry.sites[0]
        layer, path = next(((layer, path) for layer in layers for path, module in layer.named_modules()
                            if module is site.module), (site.module, ""))
        named.setdefault(id(layer), (layer, []))[1].append(f"'{path}.{site.name}'" if path else f"'{site.name}'")
    return ", ".join(f"{', '.join(names)} of a {type(layer).__name__}" for layer, names in named.values())
