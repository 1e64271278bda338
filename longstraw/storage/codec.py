"""Tensors <-> stored chunk bytes. bf16 is stored as its uint16 bit pattern (no bf16 in NumPy).

Chunk objects are Zarr v3 chunks with the plain little-endian `bytes` codec and no compression,
so a chunk's object bytes are its C-order values; edge chunks are padded with the fill value 0
to the full chunk shape, exactly as zarr writes them (checked by test_direct_chunks_match_zarr).
"""

from __future__ import annotations

import hashlib
import math
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
    """Tensor of the spec's logical dtype -> NumPy array (same strides) of the stored dtype."""
    want = TORCH_DTYPES[spec.dtype]
    if t.dtype != want:
        raise ValueError(f"{spec.name}: got dtype {t.dtype}, the layout says {want}; cast first")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # No .contiguous(): a shard's slice of the [L, T, ...] buffer is contiguous per layer, and
    # chunks are written layer by layer (a full copy cost 0.58 s per 512 MiB in page faults).
    if spec.dtype == "bfloat16":
        t = t.view(torch.uint16)
    return t.numpy()


def empty_stored(spec: ArraySpec, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Uninitialised stored-dtype array (spec.shape by default) for chunks to be read into.

    Allocated by torch, not NumPy: NumPy madvises large arrays for transparent huge pages, and on
    this VM (virtio-balloon, presumably free-page reporting) a fresh 1 GiB of huge pages right
    after 1 GiB of file I/O cost 2.5 s of kernel time to fault in, against 0.1 s when huge pages
    were at hand and a steady 0.4 s with 4 KiB pages: a verified local 1 GiB read took 0.6-3.0 s
    with NumPy's allocation, 0.5 s with this one (raw fsspec read of the same files: 0.45 s).
    """
    shape = spec.shape if shape is None else shape
    nbytes = math.prod(shape) * spec.itemsize
    flat = torch.empty(nbytes, dtype=torch.uint8).numpy()
    return flat.view(spec.stored_dtype).reshape(shape)


def stored_to_tensor(a: np.ndarray, spec: ArraySpec) -> torch.Tensor:
    t = torch.from_numpy(a)
    if spec.dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t


def split_layer_chunks(
    spec: ArraySpec, block: np.ndarray, along_index: int, shard_tokens: int
) -> list[tuple[tuple[int, ...], list[memoryview], int]]:
    """Cut a shard's block [L, n, ...] into chunks [l, along, ...] without copying the data.

    Returns (chunk index, the chunk's bytes in C order as pieces, chunk nbytes): per chunk layer,
    block[layer] (contiguous when block is an axis-1 slice of a C-contiguous array) followed by
    zero padding up to `along` rows; layers past L are all padding (zarr's edge-chunk layout).
    along_index: chunk coordinate on axis 1 (shard k for token arrays, s for checkpoints).
    """
    layers, along = spec.chunk_shape(shard_tokens)[:2]
    row_bytes = math.prod(spec.shape[2:]) * spec.itemsize
    num_layers, n = block.shape[0], block.shape[1]
    out = []
    for c, l0 in enumerate(range(0, num_layers, layers)):
        pieces: list[memoryview] = []
        for layer in range(l0, l0 + layers):
            if layer < num_layers:
                pieces.append(memoryview(np.ascontiguousarray(block[layer])).cast("B"))
                if n < along:
                    pieces.append(_zeros((along - n) * row_bytes))
            else:
                pieces.append(_zeros(along * row_bytes))
        index = (c, along_index) + (0,) * (block.ndim - 2)
        out.append((index, pieces, layers * along * row_bytes))
    return out


def _zeros(nbytes: int) -> memoryview:
    return memoryview(bytes(nbytes))
