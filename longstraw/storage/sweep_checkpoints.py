"""Sweep checkpoints: what the rest of an exact-mode reverse sweep needs, committed once.

Layout, for the backward of group g at policy version v (`sweep_dir_uri`):

    {root}/runs/{run}/policy-v{v}/sweeps/g{g}/
        attempt-{uuid}/part-{r}-of-{n}.zarr   each checkpoint write under a fresh prefix: one
                                              flat fp32 array `tensors` per rank, in chunks
        checkpoints/{swept:05d}.json          the commit marker (`SweepCheckpointManifest`),
                                              created exclusively, last

The protocol is the prompt state's (`storage.writer`): every rank writes its chunks under the
attempt's prefix (never overwritten), each chunk's size is checked and its sha256 recorded, and
only then is the marker created exclusively; a reader goes through markers only and checks each
chunk's sha256. A newer checkpoint's commit removes the older ones (marker first, then its
chunks), so a sweep holds one at a time; a write killed midway leaves an attempt no marker names,
which `longstraw state gc` removes after the grace period.

A part packs the rank's tensors end to end into one 1-D array (`FlatTensorEntry` offsets): a
chunk's bytes are pieces of the tensors it covers, streamed without a copy of a resident tensor,
and few large objects suit object storage (a 27B model has ~800 gradient tensors).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol

import numpy as np
import torch
import zarr

import longstraw
from longstraw.schemas.storage import (
    ChunkDigest,
    FlatTensorEntry,
    StorageConfig,
    SweepCheckpointManifest,
    SweepCheckpointPart,
    SweepKey,
)
from longstraw.storage.chunks import (
    IO_WORKERS,
    ChunkPayload,
    make_pool,
    object_sizes,
    read_chunk,
    write_chunks,
)
from longstraw.storage.codec import chunk_key, sha256_hex
from longstraw.storage.errors import StateIntegrityError
from longstraw.storage.exclusive import create_exclusive
from longstraw.storage.layout_io import RAW_CHUNKS, consolidated, zarr_store
from longstraw.storage.paths import (
    attempt_dir_name,
    filesystem,
    numbered_json,
    sweep_dir_uri,
)

SWEEP_CHECKPOINTS_DIR = "checkpoints"
ARRAY_NAME = "tensors"
CHUNK_ELEMENTS = 16 * 2**20
"""Elements per chunk: 64 MiB of fp32, the prompt state's chunk scale (large objects suit S3;
4 in flight per process keep two cores hashing)."""


class FlatTensor(Protocol):
    """A tensor a checkpoint holds, seen as its C-order elements (fp32)."""

    name: str
    shape: tuple[int, ...]

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) as a 1-D contiguous fp32 CPU tensor."""

    def write(self, start: int, values: torch.Tensor) -> None:
        """Set the elements from `start` on to `values` (1-D fp32 CPU)."""


def marker_name(swept: int) -> str:
    return f"{SWEEP_CHECKPOINTS_DIR}/{swept:05d}.json"


def part_name(rank: int, ranks: int) -> str:
    return f"part-{rank}-of-{ranks}.zarr"


class SweepCheckpointStore:
    """The sweep checkpoints of one backward (its group at its policy version)."""

    def __init__(self, config: StorageConfig, key: SweepKey, chunk_elements: int = CHUNK_ELEMENTS):
        self.config = config
        self.key = key
        self.chunk_elements = chunk_elements
        self.dir_uri = sweep_dir_uri(config, key.run_id, key.policy_version, key.group)
        self.fs, self.dir_path = filesystem(self.dir_uri, config)

    # ---------------------------------------------------------------- finding
    def committed(self) -> list[int]:
        """`swept` of every marker present, ascending."""
        return numbered_json(self.fs, f"{self.dir_path}/{SWEEP_CHECKPOINTS_DIR}")

    def marker_uri(self, swept: int) -> str:
        return f"{self.dir_uri}/{marker_name(swept)}"

    def read_marker(self, swept: int) -> SweepCheckpointManifest:
        """The manifest of marker `swept` (a marker that does not parse: StateIntegrityError)."""
        data = self.fs.cat_file(f"{self.dir_path}/{marker_name(swept)}")
        try:
            return SweepCheckpointManifest.model_validate_json(data)
        except ValueError as error:
            raise StateIntegrityError(
                f"{self.marker_uri(swept)} does not parse ({type(error).__name__})"
            ) from None

    # ---------------------------------------------------------------- writing
    def new_attempt(self) -> str:
        return uuid.uuid4().hex

    def write_part(
        self, attempt_id: str, rank: int, ranks: int, tensors: Sequence[FlatTensor]
    ) -> SweepCheckpointPart:
        """Write one rank's tensors into its flat array under the attempt; every chunk's size is
        checked and its sha256 recorded."""
        entries, offset = [], 0
        for tensor in tensors:
            entries.append(
                FlatTensorEntry(name=tensor.name, shape=tuple(tensor.shape), offset=offset)
            )
            offset += math.prod(tensor.shape)
        size, step = offset, self.chunk_elements
        relative = f"{attempt_dir_name(attempt_id)}/{part_name(rank, ranks)}"
        zarr_path = f"{self.dir_path}/{relative}"
        _create_flat_array(f"{self.dir_uri}/{relative}", size, step, self.config)
        digests: list[ChunkDigest] = []
        pool = make_pool()
        try:
            batch: list[ChunkPayload] = []
            for j in range(math.ceil(size / step)):
                batch.append(_chunk_payload(tensors, entries, j, step, size))
                # A bounded batch: the pieces of a tiered tensor are copies, held until written.
                if len(batch) == 2 * IO_WORKERS:
                    digests += write_chunks(self.fs, zarr_path, batch, pool)
                    batch = []
            if batch:
                digests += write_chunks(self.fs, zarr_path, batch, pool)
        finally:
            pool.shutdown(wait=True)
        return SweepCheckpointPart(
            rank=rank,
            tensors=tuple(entries),
            num_elements=size,
            chunk_elements=step,
            chunks=tuple(digests),
        )

    def commit(
        self, attempt_id: str, swept: int, parts: Sequence[SweepCheckpointPart], record: dict
    ) -> SweepCheckpointManifest:
        """Check every part's chunks are present with their sizes, then create the marker
        exclusively; the older checkpoints are removed after it."""
        self._verify_present(attempt_id, parts)
        manifest = SweepCheckpointManifest(
            key=self.key,
            swept=swept,
            attempt_id=attempt_id,
            parts=tuple(parts),
            record=record,
            code_version=longstraw.__version__,
            created_at=datetime.now(UTC),
        )
        data = manifest.model_dump_json(indent=1).encode()
        if not create_exclusive(self.fs, f"{self.dir_path}/{marker_name(swept)}", data):
            # A marker of this position exists: an earlier attempt of this very backward (the
            # caller removes those of any other key before it writes), so the same numbers.
            manifest = self.read_marker(swept)
        self.remove(*[s for s in self.committed() if s < swept])
        return manifest

    def _verify_present(self, attempt_id: str, parts: Sequence[SweepCheckpointPart]) -> None:
        expected = {}
        for part in parts:
            base = (
                f"{self.dir_path}/{attempt_dir_name(attempt_id)}/{part_name(part.rank, len(parts))}"
            )
            for d in part.chunks:
                expected[f"{base}/{chunk_key(d.array, d.index)}"] = d
        sizes = object_sizes(self.fs, list(expected))
        for (path, d), size in zip(expected.items(), sizes, strict=True):
            if size != d.nbytes:
                raise StateIntegrityError(
                    f"cannot commit a sweep checkpoint: chunk {d.index} is "
                    f"{'missing' if size is None else f'{size} bytes'} at {path} "
                    f"(written: {d.nbytes})"
                )

    # ---------------------------------------------------------------- reading back
    def read_part(
        self, manifest: SweepCheckpointManifest, rank: int, tensors: Sequence[FlatTensor]
    ) -> None:
        """Put rank `rank`'s part of `manifest` into `tensors` (the same names and shapes, in
        the same order), each chunk checked against its sha256 (ChunkChecksumError)."""
        part = manifest.parts[rank]
        given = [(t.name, tuple(t.shape)) for t in tensors]
        held = [(e.name, e.shape) for e in part.tensors]
        if given != held:
            pairs = enumerate(zip(held, given, strict=False))
            at = next((i for i, (h, g) in pairs if h != g), min(len(held), len(given)))
            raise StateIntegrityError(
                f"{self.marker_uri(manifest.swept)} holds {len(held)} tensors, this backward "
                f"{len(given)}; the first that differs: {_entry(held, at)} there, "
                f"{_entry(given, at)} here"
            )
        relative = f"{attempt_dir_name(manifest.attempt_id)}/{part_name(rank, len(manifest.parts))}"
        zarr_path = f"{self.dir_path}/{relative}"
        step, size = part.chunk_elements, part.num_elements
        pool = make_pool()
        try:
            for first in range(0, len(part.chunks), IO_WORKERS):
                batch = part.chunks[first : first + IO_WORKERS]
                reads = [pool.submit(read_chunk, self.fs, zarr_path, d, True) for d in batch]
                for d, done in zip(batch, reads, strict=True):
                    values = torch.from_numpy(np.frombuffer(done.result(), dtype="<f4").copy())
                    _scatter_chunk(tensors, part.tensors, d.index[0], step, size, values)
        finally:
            pool.shutdown(wait=True)

    # ---------------------------------------------------------------- removing
    def remove(self, *swept: int) -> None:
        """Remove those checkpoints: each marker first, then its attempt (a crash in between
        leaves chunks no marker names, which gc collects)."""
        for s in swept:
            try:
                attempt = self.read_marker(s).attempt_id
            except (FileNotFoundError, StateIntegrityError):
                attempt = None
            self.fs.rm(f"{self.dir_path}/{marker_name(s)}")
            if attempt is not None:
                path = f"{self.dir_path}/{attempt_dir_name(attempt)}"
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=True)


def remove_sweep_checkpoints(
    config: StorageConfig, run_id: str, policy_version: int, group: int
) -> None:
    """Remove every sweep checkpoint and attempt of group `group`'s backward at that version
    (its result is stored): the markers first, so none is left naming removed chunks."""
    fs, path = filesystem(sweep_dir_uri(config, run_id, policy_version, group), config)
    fs.invalidate_cache(path)
    for directory in (f"{path}/{SWEEP_CHECKPOINTS_DIR}", path):
        if fs.exists(directory):
            fs.rm(directory, recursive=True)


def _entry(entries: list, at: int) -> str:
    return "none" if at >= len(entries) else f"{entries[at][0]} {list(entries[at][1])}"


def _create_flat_array(zarr_uri: str, size: int, chunk: int, config: StorageConfig) -> None:
    """Zarr metadata of a part: one 1-D fp32 array, uncompressed, every chunk written."""
    store = zarr_store(zarr_uri, config)
    root = zarr.create_group(store=store)
    root.create_array(
        ARRAY_NAME,
        shape=(size,),
        chunks=(chunk,),
        dtype="float32",
        **RAW_CHUNKS,
    )
    consolidated(store)


def _overlaps(entries: Sequence[FlatTensorEntry], lo: int, hi: int):
    """(index of the tensor, its first element, its last + 1) of each tensor overlapping
    elements [lo, hi) of the flat array, as ranges inside the tensor."""
    for i, entry in enumerate(entries):
        numel = math.prod(entry.shape)
        start, stop = max(lo, entry.offset), min(hi, entry.offset + numel)
        if start < stop:
            yield i, start - entry.offset, stop - entry.offset


def _chunk_payload(tensors, entries, j: int, step: int, size: int) -> ChunkPayload:
    lo, hi = j * step, min((j + 1) * step, size)
    pieces = []
    for i, start, stop in _overlaps(entries, lo, hi):
        values = tensors[i].read(start, stop)
        assert values.dtype == torch.float32 and values.numel() == stop - start, tensors[i].name
        pieces.append(memoryview(values.contiguous().numpy()).cast("B"))
    if hi - lo < step:  # the edge chunk, padded with the fill value as zarr stores it
        pieces.append(memoryview(bytes((step - (hi - lo)) * 4)))
    return ChunkPayload(ARRAY_NAME, (j,), pieces, step * 4)


def _scatter_chunk(tensors, entries, j: int, step: int, size: int, values: torch.Tensor) -> None:
    lo, hi = j * step, min((j + 1) * step, size)
    for i, start, stop in _overlaps(entries, lo, hi):
        at = entries[i].offset + start - lo
        tensors[i].write(start, values[at : at + stop - start])


def digest_json(value) -> str:
    """sha256 of a JSON value in canonical form (sorted keys): a `SweepKey` field."""
    return sha256_hex(json.dumps(value, sort_keys=True).encode())


__all__ = [
    "CHUNK_ELEMENTS",
    "FlatTensor",
    "SweepCheckpointStore",
    "digest_json",
    "remove_sweep_checkpoints",
]
