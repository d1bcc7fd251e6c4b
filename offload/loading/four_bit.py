"""Linear layers quantised to bitsandbytes 4-bit (QLoRA's base), on the meta device or the CPU, and
4-bit weights quantised from a checkpoint as they are read (Note: [Quantizing while loading]).

``bitsandbytes`` is passed in by the caller, never imported here: the commands import it quietly
(``offload/cli/quantize.py``), the loader where it is asked to quantise.

Note: [Quantizing while loading]
    ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` reads each
    weight and quantises it (``Params4bit(value, **meta_weight.__dict__).to(device)``), but it
    builds the whole model before anything is offloaded. Loading slice by slice does the same
    quantisation without the model ever being whole:

    1. The meta model's linear layers (every ``nn.Linear`` but the output head, as transformers'
       default skip list) become frozen ``Linear4bit`` quantised *on the meta device*:
       bitsandbytes' operators have meta kernels, so each weight gets the shapes and dtypes of its
       codes and of its quantisation state's tensors, which the slices lay out as usual (the
       state's tensors as companions: Note: [Quantized weights] in ``offload/streams/quantized.py``).
    2. A stored weight that fills a 4-bit weight is matched by the weight's shape before
       quantisation (``quant_state.shape``), and read into a temporary of that shape in the
       model's dtype; the temporary is quantised on the CPU exactly as ``from_pretrained``
       quantises it, and the codes and every state tensor are copied into their host copies.

    The process holds the quantised host copies, the unquantised rest, and one weight in flight
    (its bf16 values and their codes): never the model in bf16.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
from torch import nn

from ..streams.quantized import is_4bit_weight, state_at, state_tensors
from .safetensors_files import SafetensorsCheckpoint

#: The 4-bit formats bitsandbytes offers (``bnb_4bit_quant_type``).
QUANT_TYPES = ("nf4", "fp4")


def quantize_linears(hf: nn.Module, bnb: ModuleType, *, quant_type: str, double_quant: bool,
                     compute_dtype: torch.dtype, device: str | torch.device = "cpu") -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``hf`` but its output head by a frozen ``Linear4bit``
    holding the same weight quantised on ``device`` (``"meta"``: the shapes and dtypes alone).

    Args:
        hf: a Hugging Face causal LM (its head is ``get_output_embeddings()``), on the CPU or meta device.
        bnb: the ``bitsandbytes`` module.
        quant_type: ``"nf4"`` or ``"fp4"``.
        double_quant: quantise the blocks' scales again (``bnb_4bit_use_double_quant``).
        compute_dtype: the dtype the layers dequantise to and compute in (``bnb_4bit_compute_dtype``).
        device: where to quantise; ``"cpu"`` for host copies.

    Returns:
        ``hf``.

    Raises:
        ValueError: an unknown ``quant_type``, or no ``nn.Linear`` to quantise (GPT-2's are ``Conv1D``).
    """
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {', '.join(QUANT_TYPES)}, got {quant_type!r}")
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


def unquantized_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape a checkpoint stores ``tensor`` in: a 4-bit weight's before quantisation, any
    other tensor's own."""
    return tensor.quant_state.shape if is_4bit_weight(tensor) else tensor.shape  # type: ignore[attr-defined]


def read_quantized(checkpoint: SafetensorsCheckpoint, name: str, weight: torch.Tensor) -> None:
    """Read stored tensor ``name`` and quantise it into the 4-bit ``weight``'s host copies: its
    codes and every tensor of its quantisation state, as ``from_pretrained`` quantises it
    (Note: [Quantizing while loading], rule 2).

    Raises:
        ValueError: the stored tensor's shape is not the weight's before quantisation.
    """
    state = weight.quant_state  # type: ignore[attr-defined]
    values = torch.empty(state.shape, dtype=state.dtype)
    checkpoint.read_into(name, values)
    # The class and attributes transformers' Bnb4bitQuantize gives it: the meta weight's, but its
    # layer, whose quant_state a quantisation would point at the temporary's.
    attributes = {k: v for k, v in weight.__dict__.items() if k not in ("quant_state", "bnb_quantized", "module")}
    quantized = type(weight)(values, requires_grad=False, **attributes).to("cpu")
    del values  # the unquantised weight goes before the next one is read
    weight.data.copy_(quantized.data)
    for path, tensor in state_tensors(quantized, repr(name)):
        state_at(weight, path).copy_(tensor)
