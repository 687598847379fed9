"""A `.gguf` file's metadata and tensors, read over a memory map with `struct` and numpy.

gguf-py's `GGUFReader` builds numpy views and Python objects for every part of every metadata
value: ~5 s per open of SmolLM2's file on a 2-core CPU (its vocabulary and merges are 98k strings),
most of what a first `eejax.load` spent converting it. This reads the same format (GGUF v2 and v3:
a header, key-values, a tensor table, then the aligned tensor data) into plain values in ~0.1 s,
with gguf-py's own type tables, and gives each tensor's bytes as `GGUFReader` gives them
(quantized: uint8 [..., rows, bytes per row]; float: values [..., rows, cols]), so gguf-py's
`dequantize` and eejax's block reader take them alike (`tests/test_conversion.py` checks both
readers agree).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# GGML types stored as plain values (the rest are blocks)
PLAIN_TYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` is GGML's (fastest dimension first: a matrix's [cols, rows]),
    `tensor_type` gguf-py's `GGMLQuantizationType`, `data` a read-only view of the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: object
    data: np.ndarray


def read_gguf(path: str | Path) -> tuple[dict, dict[str, GGUFTensor]]:
    """(metadata {key: str, number, bool or list}, tensors {name: GGUFTensor}) of a GGUF file.
    Raises ValueError for a file that is not GGUF v2 or v3 or that ends early."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        if f.seek(0, 2) < 24:
            raise ValueError("GGUF magic invalid (the file is too short)")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if data[:4] != b"GGUF":
        raise ValueError("GGUF magic invalid")
    try:
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; eejax reads versions 2 and 3")
        reader = _Reader(data, 24)
        metadata = {}
        for _ in range(kv_count):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        table = []
        for _ in range(tensor_count):
            name = reader.string()
            dims = tuple(reader.scalar("<Q") for _ in range(reader.scalar("<I")))
            table.append((name, dims, GGMLQuantizationType(reader.scalar("<I")), reader.scalar("<Q")))
    except struct.error as e:
        raise ValueError(f"the GGUF file ends early ({e})") from None
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        lead = tuple(reversed(dims[1:]))
        if kind.name in PLAIN_TYPES:
            dtype, shape = np.dtype(PLAIN_TYPES[kind.name]), (*lead, dims[0])
        else:
            dtype, shape = np.dtype(np.uint8), (*lead, dims[0] // block * block_bytes)
        count = int(np.prod(shape))
        if start + offset + count * dtype.itemsize > len(data):
            raise ValueError(f"the GGUF file ends inside tensor {name}")
        values = np.frombuffer(data, dtype, count, start + offset).reshape(shape)
        tensors[name] = GGUFTensor(name, dims, kind, values)
    return metadata, tensors


class _Reader:
    """Values from `data` at a moving position."""

    def __init__(self, data, pos: int):
        self.data, self.pos = data, pos

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.data):
            raise struct.error("a string runs past the end")
        text = self.data[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind in SCALARS:
            return self.scalar(SCALARS[kind])
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        element, count = self.scalar("<I"), self.scalar("<Q")
        if element in SCALARS and element != 7:
            dtype = np.dtype(SCALARS[element])
            values = np.frombuffer(self.data, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        return [self.value(element) for _ in range(count)]
