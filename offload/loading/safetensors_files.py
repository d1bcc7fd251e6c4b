"""Reading tensors of a safetensors checkpoint, one at a time, into memory the caller owns.

A checkpoint is one ``.safetensors`` file, or a folder holding ``model.safetensors`` or the shards
named by ``model.safetensors.index.json`` (the layout ``save_pretrained`` writes). Each file starts
with an 8-byte little-endian header length and a JSON header giving every tensor's dtype, shape
and byte range in the data that follows; this module reads those headers and then each tensor's
bytes with ``os.preadv`` straight into the destination (a host copy), so no second copy of the
model exists in the process: not a state dict, not a memory map whose pages stay resident. Only
when the destination's dtype differs from the file's (bfloat16 weights into float32 masters) does
a tensor pass through a temporary of its own size, which is then cast into place. Two stored
tensors can also be compared (the copies of a tied weight), a span of each at a time.

This module reads; deciding where each tensor goes belongs to ``offload/loading/sequential.py``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

#: The name ``save_pretrained`` gives an unsharded checkpoint, and the index of a sharded one.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: safetensors dtype names, as the format's specification spells them.
DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

#: Bytes one preadv call asks for: Linux returns at most about 2 GiB per call anyway.
_READ_CHUNK = 1 << 30

#: Bytes of each tensor that ``same_values`` holds at a time: two spans in memory, never a tensor whole.
_COMPARE_SPAN = 1 << 26


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in a checkpoint file.

    Attributes:
        file: the file that holds it.
        dtype / shape: as the header says.
        offset: absolute byte offset of its first byte in the file.
    """

    file: Path
    dtype: torch.dtype
    shape: torch.Size
    offset: int

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint, by name, read on request.

    Args:
        path: a ``.safetensors`` file, or a folder with ``model.safetensors`` or
            ``model.safetensors.index.json`` and the shards it names. A leading ``~`` is expanded.

    Raises:
        FileNotFoundError: no such file, or a folder with neither file (other formats are not read).
        ValueError: a file whose header is not valid safetensors (the message names the file), or
            a tensor named in two files.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        self.tensors: dict[str, StoredTensor] = {}
        for file in self._files():
            for name, stored in _read_header(file).items():
                if name in self.tensors:
                    raise ValueError(f"tensor '{name}' is stored twice: in {self.tensors[name].file} and in {file}")
                self.tensors[name] = stored

    def _files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        if not self.path.is_dir():
            raise FileNotFoundError(f"no checkpoint at {self.path}: pass a .safetensors file or a model folder")
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map')") from error
            return [self.path / name for name in dict.fromkeys(weight_map.values())]
        if (self.path / SINGLE_FILE).is_file():
            return [self.path / SINGLE_FILE]
        raise FileNotFoundError(
            f"{self.path} holds neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors checkpoints are read "
            "(save the model with save_pretrained(..., safe_serialization=True), the default)"
        )

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> StoredTensor:
        return self.tensors[name]

    def read_into(self, name: str, destination: torch.Tensor) -> None:
        """Read tensor ``name`` into ``destination`` (a tensor of the same shape), casting to its
        dtype. Bytes go straight into ``destination`` when it is in host memory, contiguous and of
        the stored dtype; otherwise (a resident slice's tensor is on the device) through one
        temporary of the stored tensor's size.

        Raises:
            ValueError: ``destination`` has another shape (the message names the tensor and file).
            OSError: the file ends early or cannot be read.
        """
        stored = self.tensors[name]
        if destination.shape != stored.shape:
            raise ValueError(f"tensor '{name}' in {stored.file} has shape {tuple(stored.shape)}, but the model's "
                             f"is {tuple(destination.shape)}")
        direct = destination.device.type == "cpu" and destination.dtype == stored.dtype and destination.is_contiguous()
        target = destination if direct else torch.empty(stored.shape, dtype=stored.dtype)
        _read_bytes(stored, name, target)
        if not direct:
            with torch.no_grad():
                destination.copy_(target)

    def same_values(self, name: str, other: str, dtype: torch.dtype) -> bool:
        """Whether tensors ``name`` and ``other`` hold the same values once each is cast to ``dtype``
        (the model's: values that differ only below its precision are the same), as ``torch.equal``
        says (a NaN equals nothing). They are read side by side a span at a time, so the memory
        this takes is two spans, whatever the tensors' size.

        Raises:
            OSError: a file ends early or cannot be read.
        """
        first, second = self.tensors[name], self.tensors[other]
        if first.shape != second.shape:
            return False
        count = first.shape.numel()
        span = max(1, _COMPARE_SPAN // max(first.dtype.itemsize, second.dtype.itemsize, dtype.itemsize))
        for start in range(0, count, span):
            length = min(span, count - start)
            values = [_read_span(stored, key, start, length).to(dtype)
                      for key, stored in ((name, first), (other, second))]
            if not torch.equal(*values):
                return False
        return True


def _read_span(stored: StoredTensor, name: str, start: int, length: int) -> torch.Tensor:
    """Elements ``start`` to ``start + length`` of the stored tensor, flattened, in its dtype."""
    target = torch.empty(length, dtype=stored.dtype)
    _read_bytes(stored, name, target, start * stored.dtype.itemsize)
    return target


def _read_bytes(stored: StoredTensor, name: str, target: torch.Tensor, skip: int = 0) -> None:
    """Fill ``target`` with the stored tensor's bytes from byte ``skip`` of it on."""
    nbytes = target.numel() * target.element_size()
    if nbytes == 0:
        return
    buffer = memoryview(target.view(-1).view(torch.uint8).numpy())
    with open(stored.file, "rb", buffering=0) as handle:
        done = 0
        while done < nbytes:
            count = os.preadv(handle.fileno(), [buffer[done:done + _READ_CHUNK]], stored.offset + skip + done)
            if count == 0:
                raise OSError(f"{stored.file} ends inside tensor '{name}' ({skip + done} of {stored.nbytes} bytes "
                              "read)")
            done += count


def _read_header(file: Path) -> dict[str, StoredTensor]:
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if header_len < 2 or 8 + header_len > size:
            raise ValueError(f"{file} is not a safetensors file (no valid header length)")
        try:
            header = json.loads(handle.read(header_len))
        except ValueError as error:
            raise ValueError(f"{file} is not a safetensors file (its header is not JSON)") from error
    data_start = 8 + header_len
    tensors: dict[str, StoredTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = torch.Size(info["shape"])
            begin, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"tensor '{name}' in {file} has a header entry this reader does not understand: "
                             f"{info!r}") from error
        stored = StoredTensor(file, dtype, shape, data_start + begin)
        if end - begin != stored.nbytes or data_start + end > size:
            raise ValueError(f"tensor '{name}' in {file}: its byte range {begin}..{end} does not hold "
                             f"{tuple(shape)} {info['dtype']} values within the file")
        tensors[name] = stored
    return tensors
