"""A committed prompt state read layer by layer, as the lower tier of a tiered state.

`open_streamed_state` checks the manifest (weights, policy version) like `open_committed_state`
but reads only the small linear-attention checkpoints whole; each per-token array becomes a
`ZarrTier` that reads, when rows of a layer are streamed in, just the Zarr chunks holding those
positions, verifying each chunk's sha256 against the manifest as it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from longstraw.schemas.storage import ArraySpec, ChunkDigest, PrefixStateRef, StorageConfig
from longstraw.storage.chunks import read_chunk
from longstraw.storage.codec import empty_stored, stored_to_tensor
from longstraw.storage.layout_io import chunk_region
from longstraw.storage.paths import ZARR_NAME, attempt_dir_name, filesystem
from longstraw.storage.reader import _check_expected, read_manifest

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ZarrTier:
    """One stored [L, T, *X] token array; `read_into` fetches only the chunks a slice touches."""

    def __init__(self, fs, spec: ArraySpec, shard_tokens: int, chunks: dict, verify: bool):
        self.fs, self.spec, self.shard_tokens = fs, spec, shard_tokens
        self.chunks = chunks
        """chunk index -> (zarr path of its attempt, ChunkDigest)."""
        self.verify = verify
        self.chunks_read = 0
        self.chunk_shape = spec.chunk_shape(shard_tokens)

    def read_into(self, slot: int, start: int, out: torch.Tensor) -> None:
        end = start + out.shape[0]
        layers, along = self.chunk_shape[:2]
        dest = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
        stored = dest.view(torch.uint16) if dest.dtype == torch.bfloat16 else dest
        for j in range(start // along, -(-end // along)):
            index = (slot // layers, j, *([0] * (len(self.chunk_shape) - 2)))
            zarr_path, digest = self.chunks[index]
            data = read_chunk(self.fs, zarr_path, digest, self.verify)
            self.chunks_read += 1
            chunk = np.frombuffer(data, dtype=self.spec.stored_dtype).reshape(self.chunk_shape)
            rows, cols = chunk_region(self.spec, self.shard_tokens, index)
            lo, hi = max(start, cols.start), min(end, cols.stop)
            # np.array: a writable copy of the slice (the chunk bytes are read-only).
            piece = torch.from_numpy(
                np.array(chunk[slot - rows.start, lo - cols.start : hi - cols.start])
            )
            stored[lo - start : hi - start].copy_(piece)
        if dest is not out:
            out.copy_(dest)

    def write_from(self, slot: int, start: int, src: torch.Tensor) -> None:
        raise RuntimeError("a committed prompt state is read-only; cotangents need their own tier")

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class StreamedCommittedState:
    """A committed state's per-token arrays as `ZarrTier`s and its checkpoints in memory."""

    ref: PrefixStateRef
    shard_tokens: int
    token_tiers: dict[str, tuple[ZarrTier, tuple[int, ...], torch.dtype]]
    """storage name -> (tier, [L, T, *X] shape, dtype)."""
    checkpoints: dict[str, torch.Tensor]
    """linear_attention/conv and /recurrent, read whole (constant size per shard)."""


def open_streamed_state(
    ref_or_uri: PrefixStateRef | str,
    *,
    expect_weights_digest: str,
    expect_policy_version: int | None,
    verify_checksums: bool = True,
    config: StorageConfig | None = None,
) -> StreamedCommittedState:
    """Open a committed state for streaming: nothing of prompt size is read here."""
    manifest, ref = read_manifest(ref_or_uri, config)
    _check_expected(ref, expect_weights_digest, expect_policy_version)
    layout = manifest.layout
    fs, dir_path = filesystem(ref.uri, config)
    by_array: dict[str, dict[tuple[int, ...], tuple[str, ChunkDigest]]] = {}
    for shard in manifest.shards:
        zarr_path = f"{dir_path}/{attempt_dir_name(shard.attempt_id)}/{ZARR_NAME}"
        for digest in shard.chunks:
            by_array.setdefault(digest.array, {})[tuple(digest.index)] = (zarr_path, digest)
    token_tiers, checkpoints = {}, {}
    for spec in layout.arrays:
        chunks = by_array.get(spec.name, {})
        if spec.kind == "token":
            tier = ZarrTier(fs, spec, layout.shard_tokens, chunks, verify_checksums)
            token_tiers[spec.name] = (tier, tuple(spec.shape), _TORCH_DTYPES[spec.dtype])
            continue
        out = empty_stored(spec)
        for index, (zarr_path, digest) in chunks.items():
            data = read_chunk(fs, zarr_path, digest, verify_checksums)
            chunk = np.frombuffer(data, dtype=spec.stored_dtype).reshape(
                spec.chunk_shape(layout.shard_tokens)
            )
            rows, cols = chunk_region(spec, layout.shard_tokens, index)
            out[rows, cols] = chunk[: rows.stop - rows.start, : cols.stop - cols.start]
        checkpoints[spec.name] = stored_to_tensor(out, spec)
    return StreamedCommittedState(ref, layout.shard_tokens, token_tiers, checkpoints)
