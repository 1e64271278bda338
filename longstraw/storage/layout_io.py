"""Where each chunk of a layout lands in the full arrays, and zarr metadata for an attempt."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import zarr
from zarr.codecs import BytesCodec

from longstraw.schemas.storage import ArraySpec, ChunkDigest, StateLayout, StorageConfig
from longstraw.storage.paths import s3_filesystem, storage_options

# catch_warnings() swaps process-global state: serialise our own uses of it across writer threads.
_WARNINGS_LOCK = threading.Lock()


def chunk_region(spec: ArraySpec, shard_tokens: int, index: tuple[int, ...]) -> tuple[slice, slice]:
    """(layer slice, axis-1 slice) of the full array that chunk `index` holds (edge chunks trimmed)."""
    layers, along = spec.chunk_shape(shard_tokens)[:2]
    c, j = index[0], index[1]
    return (
        slice(c * layers, min((c + 1) * layers, spec.shape[0])),
        slice(j * along, min((j + 1) * along, spec.shape[1])),
    )


def place_chunk(
    out: np.ndarray, spec: ArraySpec, shard_tokens: int, digest: ChunkDigest, data: bytes
) -> None:
    """Copy one chunk's stored bytes into its region of the full stored-dtype array `out`."""
    chunk = np.frombuffer(data, dtype=spec.stored_dtype).reshape(spec.chunk_shape(shard_tokens))
    rl, ra = chunk_region(spec, shard_tokens, digest.index)
    out[rl, ra] = chunk[: rl.stop - rl.start, : ra.stop - ra.start]


def chunk_segments(
    out: np.ndarray, spec: ArraySpec, shard_tokens: int, index: tuple[int, ...]
) -> list[tuple[memoryview | None, int]]:
    """A chunk's bytes in C order as destinations in the C-contiguous full array `out`:
    per chunk layer, the valid rows (one contiguous run of out) then the padding rows (None)."""
    layers, along = spec.chunk_shape(shard_tokens)[:2]
    row_bytes = math.prod(spec.shape[2:]) * spec.itemsize
    rl, ra = chunk_region(spec, shard_tokens, index)
    valid_rows = ra.stop - ra.start
    segments: list[tuple[memoryview | None, int]] = []
    for i in range(layers):
        layer = rl.start + i
        if layer < rl.stop:
            segments.append((memoryview(out[layer, ra]).cast("B"), valid_rows * row_bytes))
            if valid_rows < along:
                segments.append((None, (along - valid_rows) * row_bytes))
        else:
            segments.append((None, along * row_bytes))
    return segments


def zarr_store(zarr_uri: str, config: StorageConfig | None = None):
    if zarr_uri.startswith("file://"):
        return zarr.storage.LocalStore(zarr_uri[len("file://") :])
    if zarr_uri.startswith("s3://"):
        fs, path = s3_filesystem(zarr_uri, config, asynchronous=True)
        return zarr.storage.FsspecStore(fs=fs, path=path)
    return zarr.storage.FsspecStore.from_url(
        zarr_uri, storage_options=storage_options(zarr_uri, config) or None
    )


RAW_CHUNKS = {
    "fill_value": 0,
    "compressors": None,
    "filters": None,
    "serializer": BytesCodec(endian="little"),
    "chunk_key_encoding": {"name": "default", "separator": "/"},
    # Every chunk is written, zero or not: a missing chunk means an incomplete write.
    "config": {"write_empty_chunks": True},
}
"""How every array LongStraw commits stores its chunks: raw little-endian bytes, one file per
chunk (whose sha256 the manifest records), none left out."""


def create_attempt_arrays(zarr_uri: str, layout: StateLayout, config: StorageConfig) -> None:
    """Array metadata for one attempt's state.zarr, then consolidated metadata (one read lists all)."""
    store = zarr_store(zarr_uri, config)
    root = zarr.create_group(
        store=store, attributes={"longstraw_layout": layout.model_dump(mode="json")}
    )
    for a in layout.arrays:
        root.create_array(
            a.name,
            shape=a.shape,
            chunks=a.chunk_shape(layout.shard_tokens),
            dtype=a.stored_dtype,
            **RAW_CHUNKS,
            attributes={"logical_dtype": a.dtype, "kind": a.kind},
            dimension_names=["layer", "token" if a.kind == "token" else "shard_boundary"]
            + [f"dim{i}" for i in range(2, len(a.shape))],
        )
    consolidated(store)


def consolidated(store) -> None:
    """Consolidate the store's metadata (zarr's consolidated zarr.json): one read lists every
    array (128 arrays on S3: 1.3 s -> 0.04 s)."""
    with _WARNINGS_LOCK, warnings.catch_warnings():
        # Consolidated metadata is a zarr-python extension of v3 (it warns so).
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(store)
