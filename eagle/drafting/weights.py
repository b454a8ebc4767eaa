"""Reading weight files and checking state dicts, with one clear error for a damaged or mismatched file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from eagle.errors import EagleError


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a damaged or truncated file is an ``EagleError`` naming it."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
        raise EagleError(f"cannot read {path} (damaged or truncated?): {exc}") from None


def check_state(reference: dict[str, torch.Tensor], state: dict[str, torch.Tensor], what: str) -> None:
    """Refuse a state dict whose keys or shapes differ from ``reference`` (a module's state dict),
    naming the first difference."""
    expected = {k: tuple(v.shape) for k, v in reference.items()}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise EagleError(f"{what} do not match the config: missing {missing[:3] or 'none'}, "
                         f"unexpected {unexpected[:3] or 'none'}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise EagleError(f"{what} do not match the config: {key} has shape {list(state[key].shape)}, "
                             f"the config implies {list(shape)}")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class SafetensorsRows:
    """A safetensors file read by plain reads, a few rows of one tensor at a time, nothing mapped: only what is
    asked for is ever in this process's memory (safetensors' own reader maps the whole file, and every page
    read through the mapping stays resident while it is open). ``shapes``: each tensor's shape;
    ``rows(name, start, stop)``: rows ``start:stop`` of its first dimension; ``tensor(name)``: all of it. A
    damaged or truncated file is an ``EagleError`` naming it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size)) if 0 < size < 100_000_000 else None
            self._start, end = 8 + size, self.path.stat().st_size
            if not isinstance(header, dict):
                raise ValueError("no safetensors header")
            header.pop("__metadata__", None)
            self._entries = {name: (_DTYPES[e["dtype"]], [int(n) for n in e["shape"]], *map(int, e["data_offsets"]))
                             for name, e in header.items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EagleError(f"cannot read {path} (damaged or truncated?): {exc!r}") from None
        for name, (dtype, shape, begin, stop) in self._entries.items():
            if stop - begin != math.prod(shape) * dtype.itemsize or self._start + stop > end:
                raise EagleError(f"cannot read {path} (damaged or truncated?): tensor {name} does not fit the file")
        self.shapes = {name: tuple(entry[1]) for name, entry in self._entries.items()}

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        dtype, shape, begin, _ = self._entries[name]
        row = dtype.itemsize * math.prod(shape[1:])
        out = torch.empty([stop - start, *shape[1:]], dtype=dtype)
        with open(self.path, "rb") as f:
            f.seek(self._start + begin + start * row)
            if f.readinto(out.view(torch.uint8).reshape(-1).numpy()) != (stop - start) * row:
                raise EagleError(f"cannot read {self.path} (damaged or truncated?): tensor {name} is cut short")
        return out

    def tensor(self, name: str) -> torch.Tensor:
        shape = self._entries[name][1]
        return self.rows(name, 0, shape[0] if shape else 1).reshape(shape)  # a scalar: one row of nothing
