"""Model weights as safetensors, one stage at a time.

Reading: ``SafetensorsWeights`` opens a ``.safetensors`` file, or a folder holding
``model.safetensors`` or a sharded ``model.safetensors.index.json`` (the layout transformers
writes and reads), lazily with safetensors' ``safe_open``: the headers give names, shapes and
dtypes, and ``get`` reads one tensor, so a process reads the tensors of its own stages and
nothing else (``read`` lists the names it asked for).

Writing: ``write_shard`` writes one stage's tensors as ``model-0000k-of-0000n.safetensors``
(temporary file, then rename) and returns a small record (its file, names, size, checksum);
``write_index`` assembles the index from the records alone. Each process writes its own shards,
and no process ever holds more than its own stages.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class WeightsError(ValueError):
    """A weights file or folder is missing, incomplete, or does not fit the model."""


def shard_name(stage: int, num_stages: int) -> str:
    """The file of stage ``stage`` of ``num_stages``, named as transformers names shards."""
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _safe_open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as err:  # a truncated header, not a safetensors file, ...
        raise WeightsError(f"{str(path)!r} is not a readable safetensors file: {err}") from None


class SafetensorsWeights:
    """The tensors of a safetensors file or folder (module docstring), read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.read: list[str] = []  # the names ``get`` was asked for, in order
        self._handles: dict[Path, Any] = {}
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, Path]:
        p = self.path
        if p.is_file():
            return dict.fromkeys(self._open(p).keys(), p)
        if not p.is_dir():
            raise WeightsError(
                f"weights {str(p)!r} do not exist: give a .safetensors file or a folder"
            )
        if (p / INDEX).is_file():
            try:
                index = json.loads((p / INDEX).read_text())
                named = dict(index["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                raise WeightsError(
                    f"{str(p / INDEX)!r} is not a safetensors index (a JSON object with a "
                    f"'weight_map' of tensor name -> file): {err}"
                ) from None
            missing = sorted({f for f in named.values() if not (p / f).is_file()})
            if missing:
                raise WeightsError(
                    f"{str(p / INDEX)!r} names {', '.join(missing)}, missing from {str(p)!r}: "
                    "copy the whole folder, every shard with its index"
                )
            return {name: p / f for name, f in named.items()}
        if (p / SINGLE).is_file():
            return dict.fromkeys(self._open(p / SINGLE).keys(), p / SINGLE)
        others = sorted(q.name for q in p.glob("pytorch_model*.bin"))
        hint = (
            f" ({', '.join(others)} cannot be read a tensor at a time: save the model again with "
            "save_pretrained(..., safe_serialization=True))"
            if others
            else ""
        )
        raise WeightsError(f"{str(p)!r} holds no {SINGLE} and no {INDEX}{hint}")

    def _open(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = _safe_open(path)
        return self._handles[path]

    def names(self) -> set[str]:
        return set(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.weight_map[name]).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from its file now."""
        self.read.append(name)
        tensor: torch.Tensor = self._open(self.weight_map[name]).get_tensor(name)
        return tensor

    def check(self, wanted: Mapping[str, tuple[int, ...]]) -> None:
        """Every name of ``wanted`` is here with its shape, or a WeightsError listing what is
        not (before any tensor is read)."""
        missing = sorted(n for n in wanted if n not in self.weight_map)
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise WeightsError(
                f"{str(self.path)!r} lacks {len(missing)} tensor(s) the model needs: {shown}; "
                "load weights saved from this model (same family, same config)"
            )
        wrong = [(n, self.shape(n), s) for n, s in wanted.items() if self.shape(n) != tuple(s)]
        if wrong:
            name, theirs, ours = wrong[0]
            raise WeightsError(
                f"{name} has shape {list(theirs)} in {str(self.path)!r}, but the model's is "
                f"{list(ours)} ({len(wrong)} tensor(s) differ): the weights belong to another "
                "config"
            )

    def close(self) -> None:
        self._handles.clear()


def _dedup(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to write and the names that alias an earlier one (a parameter tied within
    one stage): each is stored once, and loading points the alias at it again."""
    seen: dict[tuple[Any, ...], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach()
    return tensors, aliases


DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` in the safetensors format, a tensor at a time from its own memory:
    unlike ``safetensors.torch.save_file``, which first copies every tensor into one buffer,
    this holds no second copy of the stage (format: an 8-byte little-endian header length,
    the JSON header of dtypes, shapes and byte offsets, then the raw bytes in that order)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} is {t.dtype}, which safetensors does not store here")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            if t.numel():  # a GPU tensor comes to the host one at a time
                cpu = t.to("cpu").contiguous().reshape(-1)
                f.write(cpu.view(torch.uint8).numpy().data)


def write_shard(
    folder: Path, stage: int, num_stages: int, state: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """Write ``state`` (one stage's tensors under the model's names) as the stage's shard,
    atomically; return its record for ``index_of`` (file, bytes per name, sha256, aliases)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _dedup(state)
    name = shard_name(stage, num_stages)
    tmp = folder / (name + ".tmp")
    save_safetensors(tensors, tmp)
    os.replace(tmp, folder / name)
    return {
        "stage": stage,
        "file": name,
        "sizes": {n: t.numel() * t.element_size() for n, t in sorted(tensors.items())},
        "sha256": sha256(folder / name),
        "aliases": aliases,
    }


def index_of(records: Iterable[Mapping[str, Any]], drop: Iterable[str] = ()) -> dict[str, Any]:
    """The index transformers reads, from the shards' records (``drop``: names left out)."""
    dropped = set(drop)
    weight_map: dict[str, str] = {}
    total = 0
    for record in records:
        for name, size in record["sizes"].items():
            if name not in dropped:
                weight_map[name] = record["file"]
                total += int(size)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def write_index(folder: Path, index: Mapping[str, Any]) -> Path:
    path = folder / INDEX
    tmp = folder / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_shard(path: Path, aliases: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of one shard, with the aliased names pointing at the same tensor again."""
    from safetensors.torch import load_file

    try:
        state: dict[str, torch.Tensor] = load_file(str(path))
    except Exception as err:
        raise WeightsError(f"{str(path)!r} cannot be read as safetensors: {err}") from None
    for name, kept in (aliases or {}).items():
        state[name] = state[kept]
    return state
