"""Minimal safetensors reader/writer on NumPy, written from the format description.

Layout: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the data section the offsets index. BF16 tensors are carried as uint16 bit patterns
(NumPy has no bfloat16); F8_E4M3 as uint8.
"""

import json
import os
import struct

import numpy as np

# safetensors dtype name -> (NumPy storage dtype, bytes per element)
DTYPES = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "I32": np.dtype("<i4"),
    "U8": np.dtype("u1"),
    "F8_E4M3": np.dtype("u1"),
}


class Tensor:
    """A tensor as stored: safetensors dtype name and a NumPy array of its storage type."""

    def __init__(self, dtype, array):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype}")
        self.dtype = dtype
        self.array = np.ascontiguousarray(array, dtype=DTYPES[dtype])


def write(path, tensors, metadata=None):
    """tensors: {name: Tensor}; metadata: {str: str}. Writes atomically."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        t = tensors[name]
        blob = t.array.tobytes()
        header[name] = {"dtype": t.dtype, "shape": list(t.array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    temp = f"{path}.tmp.{os.getpid()}"
    with open(temp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(temp, path)


def read(path):
    """Returns ({name: Tensor}, metadata dict)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: truncated")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path}: header length {n} exceeds the file")
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        dt = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape)) if shape else 1
        if end - begin != count * dt.itemsize or end > len(body):
            raise ValueError(f"{path}: bad data_offsets for {name}")
        tensors[name] = Tensor(info["dtype"], np.frombuffer(body[begin:end], dtype=dt).reshape(shape))
    return tensors, metadata


def bf16_bits_to_f64(bits):
    """uint16 bf16 bit patterns -> float64 (exact)."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def f64_to_bf16_bits(x):
    """float values -> bf16 bit patterns, round to nearest even (NaN kept quiet)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded
