"""A 4-bit weight's quantisation state in a checkpoint: read before the load, checked, and the
parts a load in place cannot reach set after it (Note: [Packed quantisation state]). What it does
not hold: the state in a slice (``offload/streams/quantized.py``).

Note: [Packed quantisation state]
    bitsandbytes saves a 4-bit weight (``Params4bit``) as its codes, its state's tensors
    (``absmax``, ``quant_map`` and, under double quantisation, ``nested_absmax`` and
    ``nested_quant_map``) and one uint8 tensor, ``quant_state.bitsandbytes__<nf4|fp4>``, that
    packs the rest as JSON: the format (quant type, block sizes, dtypes, the weight's shape) and,
    under double quantisation, ``nested_offset``, the float the 8-bit scales are stored around.
    Three things follow for a checkpoint, which DCP loads into the model's tensors in place:

    1. The packed tensor's length depends on the offset's decimal digits: two models of the same
       format may differ by a byte. Its length is not compared with the model's; its format is,
       field by field, before anything is loaded (a load of it alone, a few hundred bytes a
       weight), and a checkpoint of another format is refused as one of another model is.
    2. ``state_dict()`` hands out that packed tensor, and a clone of ``nested_quant_map``, made
       anew: a load into them reaches nothing. After the load the weight's state takes the
       saved offset and nested code table. Without that, a checkpoint of another base (its codes
       and scales loaded in place) would dequantize around this model's offset, silently.
    3. Without double quantisation the packed tensor holds the format alone; nothing is set.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

#: What bitsandbytes names a packed state after (``QuantState.as_dict(packed=True)``).
PACKED = ".quant_state.bitsandbytes__"
#: The packed field set after the load (rule 2); the others are the format (rule 1).
_OFFSET = "nested_offset"


def is_packed(name: str) -> bool:
    """Whether ``name`` is a 4-bit weight's packed quantisation state in a state dict."""
    return PACKED in name


def read_packed(path: Any, metadata: Metadata, names: list[str], group: Any) -> dict[str, dict[str, Any]]:
    """The saved packed states of ``names`` (model state names, all in the checkpoint), unpacked."""
    state: dict[str, Any] = {}
    for name in names:
        entry = metadata.state_dict_metadata[f"model/{name}"]
        assert isinstance(entry, TensorStorageMetadata)
        state[f"model/{name}"] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if state:
        dcp.load(state, storage_reader=FileSystemReader(path), process_group=group, no_dist=group is None)
    return {name: unpack(state[f"model/{name}"]) for name in names}


def unpack(tensor: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(tensor.cpu().numpy()).decode("utf-8"))


def format_differences(saved: dict[str, dict[str, Any]], model_state: dict[str, torch.Tensor]) -> list[str]:
    """What differs, per weight, between the saved packed states' formats and the model's."""
    differences = []
    for name, there in saved.items():
        here = unpack(model_state[name])
        fields = sorted((there.keys() | here.keys()) - {_OFFSET})
        changed = [f"{field} {there.get(field)!r} there, {here.get(field)!r} here" for field in fields
                   if there.get(field) != here.get(field)]
        if changed or (_OFFSET in there) != (_OFFSET in here):
            changed = changed or ["double quantisation " + ("on there, off here" if _OFFSET in there else "off there, on here")]
            differences.append(f"{name.removesuffix(name[name.index(PACKED):])}'s 4-bit format: " + ", ".join(changed))
    return differences


def set_unreached(model: nn.Module, saved: dict[str, dict[str, Any]], loaded: dict[str, Any]) -> None:
    """Give each double-quantised weight the saved offset and nested code table (rule 2);
    ``loaded`` is the state DCP loaded, by its ``model/<name>`` keys."""
    for name, fields in saved.items():
        if _OFFSET not in fields:
            continue
        weight_name = name[:name.index(PACKED)]
        state = model.get_parameter(weight_name).quant_state  # type: ignore[attr-defined]
        with torch.no_grad():
            state.offset.fill_(fields[_OFFSET])
            code = loaded.get(f"model/{weight_name}.nested_quant_map")
            if code is not None:
                state.state2.code.copy_(code)
