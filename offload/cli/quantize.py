"""The 4-bit base the commands build: ``offload plan --quantize`` on the meta device, to count it,
and ``offload-finetune --load-in-4bit`` on the CPU, to train LoRA adapters over it (QLoRA; Note:
[Quantized weights] in ``offload/streams/quantized.py``).

Both quantise what ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))``
quantises: every ``nn.Linear`` but the output head becomes a frozen bitsandbytes ``Linear4bit``
(its weight's codes, two a byte, and their quantisation state). On the meta device bitsandbytes
quantises shapes only (its operators have meta kernels), so the planner counts the very tensors a
real quantisation makes, bytes and companions alike, without a weight read or computed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
from torch import nn

from .quiet_imports import without_import_notes

#: The 4-bit formats bitsandbytes offers (``bnb_4bit_quant_type``).
QUANT_TYPES = ("nf4", "fp4")


def import_bitsandbytes(flag: str) -> ModuleType:
    """bitsandbytes, imported without its optional kernels' notes.

    Raises:
        ImportError: it is not installed; the message names ``flag`` and what to install.
    """
    try:
        with without_import_notes(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its optional CPU kernels ("pip install kernels") are not needed
            import bitsandbytes
    except ImportError as error:
        raise ImportError(f'{error}. {flag} needs bitsandbytes: pip install "offload[bnb]"') from error
    return bitsandbytes


def quantize_linears(hf: nn.Module, *, quant_type: str, double_quant: bool, compute_dtype: torch.dtype,
                     device: str | torch.device = "cpu") -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``hf`` but its output head by a frozen ``Linear4bit``
    holding the same weight quantised on ``device`` (``"meta"``: the shapes and dtypes alone).

    Args:
        hf: a Hugging Face causal LM (its head is ``get_output_embeddings()``), on the CPU or meta device.
        quant_type: ``"nf4"`` or ``"fp4"``.
        double_quant: quantise the blocks' scales again (``bnb_4bit_use_double_quant``).
        compute_dtype: the dtype the layers dequantise to and compute in (``bnb_4bit_compute_dtype``).
        device: where to quantise; ``"cpu"`` for host copies.

    Returns:
        ``hf``.

    Raises:
        ValueError: an unknown ``quant_type``, or no ``nn.Linear`` to quantise (GPT-2's are ``Conv1D``).
        ImportError: bitsandbytes is not installed.
    """
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {', '.join(QUANT_TYPES)}, got {quant_type!r}")
    bnb = import_bitsandbytes("a 4-bit base")
    device = torch.device(device)
    head = hf.get_output_embeddings()
    found = 0
    for module in list(hf.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear or child is head:
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=compute_dtype, compress_statistics=double_quant,
                                      quant_type=quant_type, device=child.weight.device)
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=double_quant,
                                             quant_type=quant_type, module=layer)
            if child.bias is not None:
                layer.bias = child.bias
            if device.type == "meta":
                # Params4bit.to leaves a meta weight unquantised; its quantisation runs on meta
                # tensors all the same and gives the codes' and the state's shapes and dtypes.
                with _code_tables_kept(bnb):
                    layer.weight._quantize(device)
            else:
                layer = layer.to(device)
            setattr(module, name, layer)
            found += 1
    if not found:
        raise ValueError(f"{type(hf).__name__} has no nn.Linear layer but its head to quantise in 4 bits (GPT-2's "
                         "are Conv1D); load a checkpoint of it with from_pretrained(..., "
                         "quantization_config=BitsAndBytesConfig(load_in_4bit=True)), or use another family")
    return hf


@contextmanager
def _code_tables_kept(bnb: ModuleType) -> Iterator[None]:
    """A meta quantisation that leaves bitsandbytes' code tables as it found them.

    bitsandbytes caches the 8-bit table of double quantisation on the device of the first tensor
    it quantises (``functional.name2qmap``), and copies it from there to each later one's: a
    table cached on the meta device would make every later real quantisation in the process fail
    ("Cannot copy out of meta tensor"). The CPU is the default device inside: the table is built
    from Python lists, which a meta default device cannot read back.
    """
    tables = getattr(bnb.functional, "name2qmap", None)
    kept = None if tables is None else dict(tables)
    try:
        with torch.device("cpu"):
            yield
    finally:
        if tables is not None:
            tables.clear()
            tables.update(kept)


def bnb_config(*, quant_type: str, double_quant: bool, compute_dtype: torch.dtype):
    """The ``transformers.BitsAndBytesConfig`` that loads a checkpoint as :func:`quantize_linears` quantises."""
    import transformers

    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                           bnb_4bit_use_double_quant=double_quant,
                                           bnb_4bit_compute_dtype=compute_dtype)


def four_bit_counts(model: nn.Module) -> tuple[int, int]:
    """The parameters ``model``'s 4-bit weights stand for (their shape before quantisation) and
    the bytes they take with their quantisation state: ``(parameters, bytes)``."""
    from ..streams.quantized import is_4bit_weight, state_tensors

    parameters = nbytes = 0
    for name, p in model.named_parameters():
        if is_4bit_weight(p):
            parameters += p.quant_state.shape.numel()
            nbytes += p.numel() * p.element_size() + sum(t.numel() * t.element_size()
                                                        for _, t in state_tensors(p, repr(name)))
    return parameters, nbytes
