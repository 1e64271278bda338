"""Tensors <-> stored chunk bytes. bf16 is stored as its uint16 bit pattern (no bf16 in NumPy).

Chunk objects are Zarr v3 chunks with the plain little-endian `bytes` codec and no compression,
so a chunk's object bytes are its C-order values; edge chunks are padded with the fill value 0
to the full chunk shape, exactly as zarr writes them (checked by test_direct_chunks_match_zarr).
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import torch

from longstraw.schemas.storage import ArraySpec

assert sys.byteorder == "little", "chunk bytes are written as native little-endian"

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def chunk_key(array: str, index: tuple[int, ...]) -> str:
    """Zarr v3 default chunk key encoding with '/' separators."""
    return f"{array}/c/" + "/".join(str(i) for i in index)


def sha256_hex(data) -> str:
    # hashlib releases the GIL on large buffers, so hashing overlaps I/O in another thread.
    return hashlib.sha256(data).hexdigest()


def tensor_to_stored(t: torch.Tensor, spec: ArraySpec) -> np.ndarray:
    """CPU tensor of the spec's logical dtype -> contiguous NumPy array of the stored dtype."""
    want = TORCH_DTYPES[spec.dtype]
    if t.dtype != want:
        raise ValueError(f"{spec.name}: got dtype {t.dtype}, the layout says {want}; cast first")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if spec.dtype == "bfloat16":
        t = t.view(torch.uint16)
    return t.numpy()


def stored_to_tensor(a: np.ndarray, spec: ArraySpec) -> torch.Tensor:
    t = torch.from_numpy(a)
    if spec.dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t


def split_layer_chunks(
    spec: ArraySpec, block: np.ndarray, along_index: int, shard_tokens: int
) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Cut a shard's block [L, n, ...] into chunk payloads [l, along, ...] padded with zeros.

    along_index: chunk coordinate on axis 1 (shard k for token arrays, s for checkpoints).
    """
    layers, along_len = spec.chunk_shape(shard_tokens)[:2]
    out = []
    num_layers = block.shape[0]
    for c, l0 in enumerate(range(0, num_layers, layers)):
        part = block[l0 : l0 + layers]
        if part.shape[0] != layers or part.shape[1] != along_len:
            padded = np.zeros((layers, along_len, *part.shape[2:]), dtype=part.dtype)
            padded[: part.shape[0], : part.shape[1]] = part
            part = padded
        index = (c, along_index) + (0,) * (block.ndim - 2)
        out.append((index, np.ascontiguousarray(part)))
    return out
