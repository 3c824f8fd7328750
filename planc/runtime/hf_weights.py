"""A model folder's weights, read as slices: each rank reads only the bytes of the tensors (and, for a
tensor-parallel shard, the rows or columns) it holds, never a whole file.

``FolderWeights(folder)`` indexes the folder's ``*.safetensors`` files (through
``model.safetensors.index.json`` when there is one, else by their headers) and reads with
``safetensors.safe_open(...).get_slice``; a folder with only PyTorch ``*.bin`` files is memory-mapped
(``torch.load(mmap=True)``), so only the pages of the slices read are touched.
"""
from __future__ import annotations

import json
import os

import torch

from .tensor_parallel import shard_info

__all__ = ["FolderWeights", "WeightsError"]


class WeightsError(ValueError):
    """The folder's weights do not fit the model (a tensor of another shape, an unreadable index)."""


class FolderWeights:
    def __init__(self, folder: str):
        self.folder = folder
        self._open: dict[str, object] = {}
        self.where: dict[str, str] = {}   # tensor name -> file
        index = os.path.join(folder, "model.safetensors.index.json")
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.where = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError) as e:
                raise WeightsError(f"{index}: not a safetensors index ({e})") from None
            self.kind = "safetensors"
        elif files:
            from safetensors import safe_open
            for name in files:
                with safe_open(os.path.join(folder, name), framework="pt") as f:
                    self.where.update({k: name for k in f.keys()})
            self.kind = "safetensors"
        else:
            self.kind = "bin"
            bins = sorted(f for f in os.listdir(folder) if f.endswith(".bin"))
            for name in bins:
                for k in self._file(name):
                    self.where[k] = name

    def _file(self, name: str):
        if name not in self._open:
            path = os.path.join(self.folder, name)
            if self.kind == "safetensors":
                from safetensors import safe_open
                self._open[name] = safe_open(path, framework="pt")
            else:
                self._open[name] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._open[name]

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def read_into(self, key: str, param: torch.Tensor) -> None:
        """``param`` (a full tensor or a ``TensorParallel.shard``) filled with its part of ``key``."""
        f = self._file(self.where[key])
        src = f.get_slice(key) if self.kind == "safetensors" else f[key]
        shape = tuple(src.get_shape()) if self.kind == "safetensors" else tuple(src.shape)
        info = shard_info(param)
        want = list(shape)
        pieces = []
        if info is None:
            pieces.append(src[tuple(slice(None) for _ in shape)] if shape else src[...])
        else:
            dim, index, parts, blocks = info
            if dim >= len(shape) or shape[dim] % (parts * blocks):
                raise WeightsError(f"{key}: the folder's tensor {list(shape)} does not split into {parts} parts "
                                   f"along dimension {dim}")
            step, block = shape[dim] // (parts * blocks), shape[dim] // blocks
            want[dim] = step * blocks
            for b in range(blocks):
                a = b * block + index * step
                pieces.append(src[tuple(slice(a, a + step) if d == dim else slice(None) for d in range(len(shape)))])
        value = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=info[0])
        if tuple(value.shape) != tuple(param.shape) or tuple(want) != tuple(param.shape):
            raise WeightsError(f"{key}: the folder holds {list(shape)}, the model's "
                               f"{'shard' if info else 'tensor'} is {list(param.shape)}")
        with torch.no_grad():
            param.copy_(value)

    def close(self) -> None:
        for f in self._open.values():
            if hasattr(f, "__exit__"):
                f.__exit__(None, None, None)
        self._open.clear()
