"""A .safetensors file read by ourselves: its header checked against the file, its tensors views of the
file's read-only mapping (``offload_core.map_file``).

The safetensors library maps the whole file privately and writably (``UntypedStorage.from_file``),
which Linux charges against its commit limit: a file bigger than RAM + swap fails to map. A read-only
mapping is not charged, and ComfyUI's own loader maps read-only too.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_RAW_BYTES = (torch.uint8, torch.int8)  # quantized files may store fp8 scales as raw bytes; ComfyUI views them
MAX_HEADER_BYTES = 100_000_000  # what the safetensors library itself accepts


class SafetensorsFile:
    """The header of a .safetensors file, checked against the file, and its tensors as views of the file's mapping."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        file_bytes = os.path.getsize(self.path)
        if file_bytes < 8:
            raise self._invalid("it is empty" if file_bytes == 0 else f"it is only {file_bytes} bytes long")
        with open(self.path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > MAX_HEADER_BYTES:
                raise self._invalid(f"its header claims {length} bytes, more than a safetensors header may have")
            if length > file_bytes - 8:
                raise self._invalid(f"its header claims {length} bytes, the whole file has {file_bytes}")
            header = self._parse_header(f.read(length))
        self.metadata = header.pop("__metadata__", None)
        self.entries = header
        self.data_start = 8 + length
        self._check_layout(file_bytes - self.data_start)

    def _invalid(self, problem: str) -> ValueError:
        return ValueError(f"{Path(self.path).name} is not a valid safetensors file ({problem}); make sure it is a "
                          f".safetensors file and was downloaded completely")

    def _parse_header(self, raw: bytes) -> dict:
        try:
            header = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
            raise self._invalid("its header is not JSON") from None
        if not isinstance(header, dict):
            raise self._invalid("its header is not a JSON object")
        metadata = header.get("__metadata__", {})
        if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise self._invalid("its __metadata__ is not a map of strings")
        return header

    def _check_layout(self, data_bytes: int) -> None:
        """Known dtypes, sizes that match shapes, and tensors that lie inside the data and do not overlap."""
        spans = []
        for key, entry in self.entries.items():
            if not (isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= entry.keys()):
                raise self._invalid(f"its entry for {key} lacks dtype, shape or data_offsets")
            if entry["dtype"] not in _DTYPES:
                raise self._invalid(f"{key} has dtype {entry['dtype']!r}; this loader reads {', '.join(_DTYPES)}")
            shape, offsets = entry["shape"], entry["data_offsets"]
            if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
                raise self._invalid(f"{key} has shape {shape!r}, not a list of sizes")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                raise self._invalid(f"{key} has data_offsets {offsets!r}, not [start, end]")
            needed = math.prod(shape) * _DTYPES[entry["dtype"]].itemsize
            if offsets[1] - offsets[0] != needed:
                raise self._invalid(f"{key} spans {offsets[1] - offsets[0]} bytes but its shape and dtype need {needed}")
            spans.append((offsets[0], offsets[1], key))
        end, last = 0, None
        for start, stop, key in sorted(spans):
            if start < end:
                raise self._invalid(f"{key} overlaps {last}")
            end, last = stop, key
        if end > data_bytes:
            raise self._invalid(f"it is truncated: its tensors need {end} bytes of data, it holds {data_bytes}")

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPES[self.entries[key]["dtype"]]

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self.entries[key]["shape"])

    def placeholder(self, key: str) -> torch.Tensor:
        """A meta tensor with the tensor's shape and dtype."""
        return torch.empty(self.shape(key), dtype=self.dtype(key), device="meta")

    def tensor(self, mapping: torch.Tensor, key: str) -> torch.Tensor:
        """``key`` as the file stores it: a view of ``mapping`` (read-only, nothing read until used)."""
        return self.view(mapping, key, self.placeholder(key))

    def view(self, mapping: torch.Tensor, key: str, like: torch.Tensor) -> torch.Tensor:
        """``key`` as ``like`` (its shape and dtype): a view of ``mapping`` (the whole file, mapped) where the
        file holds it so; raw bytes (uint8 / int8) of the same width as an fp8 ``like`` are its bits, as
        ComfyUI ``view``s them. Another dtype is converted (as ``Tensor.copy_`` does), into anonymous memory."""
        if self.shape(key) != like.shape:
            raise ValueError(f"{key} has shape {list(self.shape(key))} in {self.path}, the model expects {list(like.shape)}")
        dtype = self.dtype(key)
        start, end = self.entries[key]["data_offsets"]
        offset = self.data_start + start
        raw = mapping[offset : offset + end - start]
        if offset % dtype.itemsize:  # (safetensors aligns tensors; a file may not)
            raw = raw.clone()
        stored = raw.view(dtype).view(like.shape)
        if dtype in _RAW_BYTES and like.dtype.is_floating_point and like.dtype.itemsize == 1:
            return stored.view(like.dtype)
        return stored if dtype == like.dtype else stored.to(like.dtype)
