"""A safetensors file written one tensor at a time: the header first (names, dtypes, shapes
and offsets are known before any value is read), then each tensor's bytes as it is read, so a
model larger than memory is written holding one tensor."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
Entry = tuple[str, tuple[int, ...], torch.dtype]  # name, shape, dtype


def write_streamed(
    path: Path, entries: list[Entry], read: Callable[[str], Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write ``entries`` to ``path`` as one safetensors file, reading each value with ``read(name)``
    just before its bytes are written (each checked against its declared shape and dtype)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, shape, dtype in entries:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for name, shape, dtype in entries:
            value = read(name)
            if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                raise ValueError(f"{name} is {tuple(value.shape)} {value.dtype}, declared {tuple(shape)} {dtype}")
            file.write(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
