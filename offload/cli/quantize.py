"""The 4-bit base the commands build: ``offload plan --quantize`` on the meta device, to count it,
and ``offload-finetune --load-in-4bit`` on the CPU, to train LoRA adapters over it (QLoRA; Note:
[Quantized weights] in ``offload/streams/quantized.py``).

Both quantise what ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))``
quantises: every ``nn.Linear`` but the output head becomes a frozen bitsandbytes ``Linear4bit``
(its weight's codes, two a byte, and their quantisation state). On the meta device bitsandbytes
quantises shapes only (its operators have meta kernels), so the planner counts the very tensors a
real quantisation makes, bytes and companions alike, without a weight read or computed. The
quantisation itself is ``offload/loading/four_bit.py``'s, which ``load_causal_lm`` shares.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch
from torch import nn

from ..loading import four_bit
from ..loading.four_bit import QUANT_TYPES
from .quiet_imports import without_import_notes

__all__ = ["QUANT_TYPES", "bnb_config", "four_bit_counts", "import_bitsandbytes", "quantize_linears"]


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
    """:func:`offload.loading.four_bit.quantize_linears` with bitsandbytes imported quietly.

    Raises:
        ValueError: an unknown ``quant_type``, or no ``nn.Linear`` to quantise (GPT-2's are ``Conv1D``).
        ImportError: bitsandbytes is not installed.
    """
    bnb = import_bitsandbytes("a 4-bit base")
    return four_bit.quantize_linears(hf, bnb, quant_type=quant_type, double_quant=double_quant,
                                     compute_dtype=compute_dtype, device=device)


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
