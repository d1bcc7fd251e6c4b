"""Quantized frozen weights in a slice: a bitsandbytes 4-bit or 8-bit weight and the tensors of
its quantisation state, which travel with it (QLoRA's base, and LoRA over an LLM.int8() base).

``bitsandbytes`` is never imported here: a 4-bit weight exists only once the user imported it, so
its classes are looked up in ``sys.modules`` (as ``offload/integrations/peft.py`` does for PEFT).

Note: [Quantized weights]
    1. A ``bitsandbytes.nn.Params4bit`` (the weight of a ``Linear4bit``, NF4 or FP4) is a uint8
       parameter holding two 4-bit codes a byte; its values mean nothing without its
       ``quant_state``: a ``QuantState`` holding the scale of each block (``absmax``), the code
       table, and under double quantisation (``compress_statistics``) the ``absmax`` quantized
       again to 8 bits with an ``offset`` and a nested state of its own (``state2.absmax``,
       ``state2.code``). Those tensors are not registered in any module, so a slice that laid out
       the weight alone would load bytes a kernel cannot read.
    2. A slice lays the state's tensors out as *companions* of the weight: entries without a
       registration site, after the slice's own parameters and before its buffers (``Entry.companions``).
       Like every host copy they move into the slice's host buffer through ``.data``, so the
       ``QuantState`` object the user's layer holds keeps working (the model still runs and saves
       unwrapped), each load copies them with the weight in the same single copy, and the footprint
       counts them once. They keep their dtype under a compute dtype: bitsandbytes dequantizes with
       the ``absmax`` it was given.
    3. A run binds at the weight's site a ``Params4bit`` over the slot's bytes whose
       ``quant_state`` is a shallow copy of the host state with every tensor replaced by its
       companion's device copy (:func:`device_weight`): ``Linear4bit.forward`` and PEFT's LoRA
       layer read both from the weight, and a copy per run means a layer that changes the state it
       is given (bitsandbytes repacks it for its CPU kernel in inference) changes nothing the next
       run sees.
    4. The weight must be frozen (``requires_grad=False``, as PEFT and ``prepare_model_for_kbit_training``
       leave it): its codes have no gradient. A trainable one, one not quantized yet (a
       ``Linear4bit`` never moved to a device keeps float values), a state tensor shared by two
       weights, a quantized weight tied across slices, an 8-bit weight that keeps float values
       (``has_fp16_weights=True``) and torchao's ``NF4Tensor`` are refused where the slice is laid
       out, each with what to do instead.
    5. bitsandbytes' ``MatMul4Bit`` keeps the weight and its state on the autograd context instead
       of saving them for backward, so saved-tensor hooks never see them: a graph kept from forward
       would read whatever its old slot holds by backward. Slices holding a 4-bit weight are
       therefore recomputed in backward (``checkpoint_activation=True``, the default); the one graph
       every walk keeps (the last microbatch of the last slice) is used while the slice is still in
       the slot it ran in, and a backward that finds it elsewhere (a second forward ran before it)
       raises rather than reading another slice's bytes. A weight the layer itself moved out of
       the slot (bitsandbytes repacks a 4-bit weight for its CPU kernel in an eval forward whose
       input needs no gradient) is memory of its own, which no slice writes: not refused.
    6. A ``bitsandbytes.nn.Int8Params`` (the weight of a ``Linear8bitLt``, ``load_in_8bit``) holds
       int8 codes, one a byte, and needs one float32 scale a row (``SCB``), its only companion. It
       keeps no state of its own once it ran: ``Linear8bitLt.forward`` moves ``CB`` (the codes) and
       ``SCB`` from the weight to the layer's ``MatmulLtState`` (``layer.state``) and computes from
       there, in forward and in backward (the autograd context holds that object). So once the
       weight moved into the host buffer its layer is put in the form a forward leaves it in
       (:func:`settle_8bit_layer`): ``state.CB`` over the weight's host copy (the ``CB`` it had
       would keep the old bytes alive), ``state.SCB`` the companion. A run binds a device weight
       without ``CB``/``SCB`` that carries a copy of that state over the device copies
       (:func:`device_state`); binding swaps it into the layer for the run and the host one back
       after it, for rule 3's reason. Training on the CPU, bitsandbytes dequantizes and runs a
       float matmul; in eval, its int8 matmul splits off the outliers (``threshold``).
    7. bitsandbytes' ``Linear8bitLt._load_from_state_dict`` takes an ``SCB`` key only while the
       weight holds its scales, and refuses it once they moved to ``layer.state`` (its own forward
       moves them too), so a settled layer could not load the state dict it saves. A load pre-hook
       (:func:`load_8bit_scales`) copies that key into ``state.SCB``, the companion, in place, and
       takes it out of the walk: the layer then computes as a fresh unwrapped one that loaded it.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch

#: The attributes of a ``QuantState`` that hold tensors its kernels read, at each level of nesting.
STATE_TENSORS = ("absmax", "code", "offset")

#: The attribute that marks a ``Linear8bitLt`` whose scales :func:`load_8bit_scales` loads (rule 7).
LOADS_SCALES = "_offload_loads_8bit_scales"

#: The attribute of an 8-bit weight's device copy that holds the ``MatmulLtState`` its layer runs
#: with (Note: [Quantized weights], rule 6).
RUN_STATE = "offload_run_state"


def _bnb_class(name: str) -> type | None:
    bnb = sys.modules.get("bitsandbytes")
    return getattr(getattr(bnb, "nn", None), name, None)


def is_4bit_weight(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a bitsandbytes 4-bit weight (``Params4bit``)."""
    params4bit = _bnb_class("Params4bit")
    return params4bit is not None and isinstance(tensor, params4bit)


def is_8bit_weight(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a bitsandbytes 8-bit weight (``Int8Params``)."""
    int8_params = _bnb_class("Int8Params")
    return int8_params is not None and isinstance(tensor, int8_params)


def state_tensors(tensor: torch.Tensor, where: str, module: torch.nn.Module | None = None
                  ) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a 4-bit weight's quantisation state, each with its path in the state
    (``"absmax"``, ``"state2.code"``), in a fixed order; an 8-bit weight's row scales (``"SCB"``);
    ``[]`` for any other tensor.

    Args:
        tensor: a parameter or buffer of a slice.
        where: how a message names it ("'weight' of Linear4bit").
        module: where ``tensor`` is registered; an 8-bit weight that ran keeps its ``SCB`` there
            (rule 6).

    Raises:
        ValueError: a quantized tensor that cannot be offloaded (Note: [Quantized weights], rule 4).
    """
    _refuse_other_quantized(tensor, where)
    if is_8bit_weight(tensor):
        return [("SCB", _8bit_scales(tensor, where, module))]
    if not is_4bit_weight(tensor):
        return []
    state = getattr(tensor, "quant_state", None)
    if not getattr(tensor, "bnb_quantized", False) or state is None:
        raise ValueError(
            f"{where} is a bitsandbytes Params4bit that is not quantized yet (it still holds float values); "
            "quantize it before wrapping: move the Linear4bit to a device (layer.to('cuda') or layer.to('cpu')), "
            "or load the model with from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))")
    if tensor.requires_grad:
        raise ValueError(
            f"{where} is a 4-bit weight that requires grad; 4-bit codes have no gradient, so OffloadModel trains "
            "adapters over a frozen 4-bit base: call requires_grad_(False) on it (peft.get_peft_model does), "
            "or load the layer unquantized to train it in full")
    found: list[tuple[str, torch.Tensor]] = []
    prefix = ""
    while state is not None:
        found += [(prefix + name, value) for name in STATE_TENSORS
                  if isinstance(value := getattr(state, name, None), torch.Tensor)]
        state, prefix = getattr(state, "state2", None), prefix + "state2."
    return found


def _8bit_scales(tensor: torch.Tensor, where: str, module: torch.nn.Module | None) -> torch.Tensor:
    """The row scales (``SCB``) of the 8-bit weight ``tensor``: on the weight until its layer ran,
    on the layer's ``state`` after (rule 6)."""
    if tensor.has_fp16_weights:  # type: ignore[attr-defined]
        raise ValueError(
            f"{where} is a bitsandbytes 8-bit weight that keeps float values (has_fp16_weights=True: it trains in "
            "full and is quantized again at every forward), which OffloadModel does not offload as 8-bit; build the "
            "Linear8bitLt with has_fp16_weights=False (load_in_8bit does) to train adapters over it, or use nn.Linear")
    state = getattr(module, "state", None)
    scales = tensor.SCB if tensor.SCB is not None else getattr(state, "SCB", None)  # type: ignore[attr-defined]
    if tensor.dtype != torch.int8 or scales is None:
        raise ValueError(
            f"{where} is a bitsandbytes Int8Params that is not quantized yet (it still holds float values); quantize "
            "it before wrapping: move the Linear8bitLt to a device (layer.to('cuda') or layer.to('cpu')), or load the "
            "model with from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True))")
    return scales  # frozen: an int8 tensor cannot require grad


def settle_8bit_layer(module: torch.nn.Module, weight: torch.Tensor, scales: torch.Tensor) -> None:
    """Put a ``Linear8bitLt`` in the form its forward leaves it in, with ``state.CB`` over the
    weight's bytes and ``state.SCB`` the companion ``scales`` (Note: [Quantized weights], rule 6):
    the layer computes as before, and the weight's host copy is the only copy of its codes."""
    module.state.CB, module.state.SCB = weight.data, scales  # type: ignore[union-attr]
    weight.CB = weight.SCB = None  # type: ignore[attr-defined]
    if not getattr(module, LOADS_SCALES, False):
        # The public register_load_state_dict_pre_hook (newer torch) registers exactly this.
        module._register_load_state_dict_pre_hook(load_8bit_scales, with_module=True)
        setattr(module, LOADS_SCALES, True)


def load_8bit_scales(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                     strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Load pre-hook of a settled ``Linear8bitLt`` (Note: [Quantized weights], rule 7): copy the
    ``SCB`` of ``state_dict`` into the scales the layer computes with, in place, and take the key."""
    scales = getattr(getattr(module, "state", None), "SCB", None)
    if prefix + "SCB" not in state_dict or module.weight.SCB is not None or scales is None:  # type: ignore[union-attr]
        return  # bitsandbytes loads it: the weight holds its scales again
    given = state_dict.pop(prefix + "SCB")
    if not isinstance(given, torch.Tensor) or given.shape != scales.shape:
        shape = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
        error_msgs.append(f"size mismatch for {prefix}SCB: copying a param with shape {shape} from checkpoint, "
                          f"the shape in current model is {tuple(scales.shape)}.")
        return
    with torch.no_grad():
        scales.copy_(given)  # the host copy: every later load of the slice reads it


def device_state(module: torch.nn.Module, weight: torch.Tensor, scales: torch.Tensor) -> Any:
    """A copy of ``module``'s ``MatmulLtState`` over the device copies ``weight`` and ``scales``
    (plain tensors: bitsandbytes copies ``CB`` with ``.to(copy=True)``), for one run (rule 6)."""
    state = copy.copy(module.state)
    state.CB, state.SCB = weight, scales
    return state


def swap_run_states(sites: Sequence[Sequence[Any]], tensors: Sequence[torch.Tensor],
                    positions: Sequence[int]) -> list[tuple[Any, Any]]:
    """Give each ``Linear8bitLt`` registered at ``sites[i]``, for ``i`` in ``positions`` (where
    its slice holds 8-bit weights), the state its bound device weight ``tensors[i]`` carries
    (rule 6); returns ``(module, state)`` pairs that :func:`restore_run_states` puts back."""
    swapped: list[tuple[Any, Any]] = []
    for i in positions:
        state = getattr(tensors[i], RUN_STATE, None)
        if state is not None:
            for site in sites[i]:
                swapped.append((site.module, site.module.state))
                site.module.state = state
    return swapped


def restore_run_states(swapped: Sequence[tuple[Any, Any]]) -> None:
    """Undo :func:`swap_run_states`."""
    for module, state in reversed(swapped):
        module.state = state


def _refuse_other_quantized(tensor: torch.Tensor, where: str) -> None:
    # By name: torchao moved the class between releases (torchao.dtypes.nf4tensor, then
    # torchao.quantization.quantize_.workflows.nf4).
    if any(c.__name__ == "NF4Tensor" and c.__module__.startswith("torchao.") for c in type(tensor).__mro__):
        raise ValueError(
            f"{where} is a torchao NF4Tensor, which OffloadModel does not offload; build the base with "
            "bitsandbytes' Linear4bit (quant_type='nf4'), or load it with "
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')")


def state_at(weight: torch.Tensor, path: str, module: torch.nn.Module | None = None) -> torch.Tensor | None:
    """The tensor at ``path`` ("state2.absmax") of ``weight``'s quantisation state now; for an
    8-bit weight, the one its layer ``module`` computes with (rule 6)."""
    if is_8bit_weight(weight):
        own = getattr(weight, path, None)
        return own if own is not None else getattr(getattr(module, "state", None), path, None)
    owner: Any = getattr(weight, "quant_state", None)
    *nested, name = path.split(".")
    for step in nested:
        owner = getattr(owner, step, None)
    return getattr(owner, name, None)


def device_weight(host: torch.Tensor, view: torch.Tensor, paths: Sequence[str],
                  state_views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The device copy a run binds for the quantized weight ``host``: a tensor of its class over
    ``view`` (the slot's bytes); for a 4-bit one with a copy of its quantisation state whose tensor
    at each of ``paths`` is the matching one of ``state_views`` (Note: [Quantized weights], rule 3),
    for an 8-bit one without ``CB``/``SCB``, which its layer reads from :func:`device_state`."""
    if is_8bit_weight(host):
        return type(host)(view, requires_grad=False, has_fp16_weights=False)  # type: ignore[call-arg]
    state = copy.copy(host.quant_state)  # type: ignore[attr-defined]
    if getattr(state, "state2", None) is not None:
        state.state2 = copy.copy(state.state2)
    for path, tensor in zip(paths, state_views):
        *nested, name = path.split(".")
        owner = state
        for step in nested:
            owner = getattr(owner, step)
        setattr(owner, name, tensor)
    weight = torch.Tensor._make_subclass(type(host), view, False)
    weight.__dict__.update(host.__dict__)  # blocksize, quant_type, module, ...: what bitsandbytes reads
    weight.quant_state = state
    return weight

