"""Streaming safetensors reader and writer, in NumPy (no torch).

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to
its dtype, shape and byte range, then the raw little-endian data. Reading one tensor maps only
its byte range, so a converter holds one tensor at a time; writing takes the shapes first
(the header), then each tensor's bytes in order, so an exporter holds one tensor at a time too.
The ``safetensors`` package's NumPy backend cannot read ``F8_E4M3`` (the released DeepSeek-V3
weights), which is why this small module exists. bfloat16 and float8 come from ``ml_dtypes``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from MaxText.hf import HFCheckpointError

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in ``file``
    end: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HFCheckpointError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise HFCheckpointError(f"{path} is not a safetensors file (bad header)") from None
    base = 8 + size
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        tensors[name] = TensorInfo(path, entry["dtype"], tuple(entry["shape"]), base + begin, base + end)
    return tensors


class SafetensorsFolder:
    """Every tensor of a folder of ``*.safetensors`` shards, read one at a time."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise HFCheckpointError(f"no *.safetensors weights in {self.directory}")
        self.tensors: dict[str, TensorInfo] = {}
        for path in files:
            for name, info in read_header(path).items():
                if name in self.tensors:
                    raise HFCheckpointError(
                        f"tensor {name} appears in both {self.tensors[name].file.name} and {path.name}"
                    )
                self.tensors[name] = info

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> np.ndarray:
        """The tensor as a NumPy array (its own memory, not a view of the file)."""
        info = self.tensors[name]
        if info.dtype not in DTYPES:
            raise HFCheckpointError(f"tensor {name} has unsupported dtype {info.dtype}")
        dtype = DTYPES[info.dtype]
        count = int(np.prod(info.shape, dtype=np.int64))
        if info.end - info.start != count * dtype.itemsize:
            raise HFCheckpointError(f"tensor {name}: byte range does not match shape {info.shape} x {info.dtype}")
        with open(info.file, "rb") as f:
            f.seek(info.start)
            return np.fromfile(f, dtype=dtype, count=count).reshape(info.shape)


def write_safetensors(path: Path, shapes: dict[str, tuple[tuple[int, ...], np.dtype]], arrays: Iterator) -> None:
    """Write ``shapes`` (name -> (shape, dtype), in file order) taking the data from ``arrays``,
    which yields ``(name, array)`` in the same order; one array is held at a time."""
    header, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for expected, (name, array) in zip(shapes, arrays, strict=True):
            shape, dtype = shapes[expected]
            if name != expected or array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
                raise ValueError(
                    f"{name} {array.shape} {array.dtype} written where {expected} {shape} {dtype} was announced"
                )
            np.ascontiguousarray(array).tofile(f)  # little-endian hosts (x86-64, aarch64)
