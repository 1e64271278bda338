"""StateWriter: persist a prompt state shard by shard and commit it exactly once.

Protocol (docs/design.md, "Storage"), for the state directory D of one StateKey:
1. Each writer is an attempt with a fresh uuid and writes chunks only under
   D/attempt-{uuid}/state.zarr. No other writer ever writes there, so no chunk object is ever
   overwritten by someone else (no torn chunk, even with a zombie writer still running).
2. write_shard(k): write shard k's chunks (token chunk k of each token array, checkpoint index k+1,
   and index 0 with shard 0), check every object exists with its size, hash the bytes, then create
   D/shards/{k:05d}.json EXCLUSIVELY naming this attempt and the hashes. Whoever creates it first
   owns shard k forever.
3. Lineage: a writer writes shard k only after it knows shard k-1 as recorded (wrote it, or read it
   back with read_shard). If it loses the race for shard k's manifest, it keeps going only when the
   winner's hashes equal its own (same bytes, so its later shards still extend the recorded state);
   otherwise ShardConflictError: its later shards would extend a state that is not the recorded one.
   An attempt writes its array metadata and consolidates it (zarr's consolidated zarr.json)
   before its first chunk; metadata never changes afterwards, so it is consolidated at commit.
4. commit(): every shard manifest 0..S-1 present, every chunk they name present with its size,
   then COMMITTED.json (the union of the shard manifests + layout + digests) created EXCLUSIVELY.
   A loser of that race returns the winner's ref after checking it is the same key and layout.
Why no torn state: the committed state is exactly the shard manifests, each names immutable
chunks written by one attempt, and consecutive manifests extend each other (rule 3). A resumed
writer is just another attempt: it reads shards 0..j back, and writes j+1.. under its own prefix.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import torch

import longstraw
from longstraw.schemas.storage import (
    PrefixStateRef,
    ShardManifest,
    StateKey,
    StateLayout,
    StateManifest,
    StorageConfig,
)
from longstraw.storage.cache import CommittedStateLRU, default_state_lru
from longstraw.storage.chunks import (
    ChunkPayload,
    for_each_chunk,
    make_pool,
    object_sizes,
    read_chunk,
    write_chunks,
)
from longstraw.storage.codec import (
    chunk_key,
    empty_stored,
    sha256_hex,
    split_layer_chunks,
    stored_to_tensor,
    tensor_to_stored,
)
from longstraw.storage.errors import ShardConflictError, StateIntegrityError, StateKeyMismatchError
from longstraw.storage.exclusive import create_exclusive
from longstraw.storage.layout_io import chunk_region, create_attempt_arrays
from longstraw.storage.paths import (
    COMMITTED_NAME,
    SHARDS_DIR,
    ZARR_NAME,
    attempt_dir_name,
    filesystem,
    numbered_json,
    shard_manifest_name,
    state_dir_uri,
)


@dataclass(frozen=True)
class ShardData:
    """One shard read back: what the engine needs to rebuild its in-memory state on resume."""

    token_slices: dict[str, torch.Tensor]
    """name -> [L, end-start, ...] the shard's positions of each token array."""
    checkpoints: dict[str, torch.Tensor]
    """name -> [L, ...] state at the END of shard k (checkpoint index k+1)."""
    initial_checkpoints: dict[str, torch.Tensor] | None
    """name -> [L, ...] checkpoint index 0 (only for k = 0)."""


def manifest_bytes(manifest: StateManifest | ShardManifest) -> bytes:
    return manifest.model_dump_json(indent=1).encode()


class StateWriter:
    """Synchronous writer of one prompt state (see the module docstring for the protocol)."""

    def __init__(
        self,
        config: StorageConfig,
        key: StateKey,
        layout: StateLayout,
        *,
        resume: bool = False,
    ):
        self.config = config
        self.key = key
        self.layout = layout
        self.attempt_id = uuid.uuid4().hex
        self.dir_uri = state_dir_uri(config, key)
        self.fs, self.dir_path = filesystem(self.dir_uri, config)
        self.zarr_path = f"{self.dir_path}/{attempt_dir_name(self.attempt_id)}/{ZARR_NAME}"
        self.zarr_uri = f"{self.dir_uri}/{attempt_dir_name(self.attempt_id)}/{ZARR_NAME}"
        self._arrays_created = False
        self._known: dict[int, ShardManifest] = {}
        """Shards this writer may extend: written, adopted or read back by it."""
        self._pool = make_pool()
        self.shards_written = 0
        """Shards whose chunks this attempt wrote (a resume test counts recomputation with it)."""
        existing = self.completed_shards()
        if existing and not resume and self.existing_commit() is None:
            raise ValueError(
                f"{self.dir_uri} has shard manifests {existing} from an earlier attempt and no "
                "COMMITTED.json: open with resume=True to continue after them (or gc the directory)"
            )

    # ---------------------------------------------------------------- discovery
    def completed_shards(self) -> list[int]:
        """Sorted indices of the shard manifests present now (any attempt)."""
        return numbered_json(self.fs, f"{self.dir_path}/{SHARDS_DIR}")

    def next_shard(self) -> int:
        """First shard index without a manifest: where a resumed prefill continues."""
        done = set(self.completed_shards())
        k = 0
        while k in done:
            k += 1
        return k

    def existing_commit(self) -> PrefixStateRef | None:
        """The ref of this key's committed state, if some writer already committed it."""
        path = f"{self.dir_path}/{COMMITTED_NAME}"
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        manifest = StateManifest.model_validate_json(data)
        self._check_same_state(manifest)
        return _ref_for(self.dir_uri, manifest, data)

    def _read_shard_manifest(self, k: int) -> ShardManifest | None:
        try:
            data = self.fs.cat_file(f"{self.dir_path}/{shard_manifest_name(k)}")
        except FileNotFoundError:
            return None
        manifest = ShardManifest.model_validate_json(data)
        if (manifest.token_start, manifest.token_end) != self.layout.shard_range(k):
            raise StateKeyMismatchError(
                f"shard {k} of {self.dir_uri} covers tokens [{manifest.token_start}, "
                f"{manifest.token_end}), this writer's layout says {self.layout.shard_range(k)}: "
                "the prompt digest must cover the shard size too"
            )
        return manifest

    # ---------------------------------------------------------------- writing
    def write_shard(
        self,
        k: int,
        token_slices: Mapping[str, torch.Tensor],
        checkpoints: Mapping[str, torch.Tensor],
        initial_checkpoints: Mapping[str, torch.Tensor] | None = None,
    ) -> ShardManifest:
        """Persist shard k and record it.

        token_slices: name -> [L, end-start, ...] for every token array.
        checkpoints: name -> [L, ...] state at the end of shard k (index k+1) for every checkpoint array.
        initial_checkpoints: name -> [L, ...] the state at the start of shard 0 (index 0); k = 0 only.
        """
        payloads = self._payloads(k, token_slices, checkpoints, initial_checkpoints)
        if k > 0 and (k - 1) not in self._known:
            raise ValueError(
                f"shard {k} written before shard {k - 1} is known to this writer: write shards in "
                f"order, and after a resume read_shard(j) every completed shard before writing more"
            )
        manifest_path = f"{self.dir_path}/{shard_manifest_name(k)}"
        existing = self._read_shard_manifest(k)
        if existing is not None:
            # Recorded already (a concurrent or earlier writer): hash only, no write.
            ours = {(p.array, p.index): p.sha256() for p in payloads}
            return self._adopt(k, existing, ours)
        if not self._arrays_created:
            create_attempt_arrays(self.zarr_uri, self.layout, self.config)
            self._arrays_created = True
        digests = write_chunks(self.fs, self.zarr_path, payloads, self._pool)
        self.shards_written += 1
        start, end = self.layout.shard_range(k)
        manifest = ShardManifest(
            shard_index=k,
            token_start=start,
            token_end=end,
            attempt_id=self.attempt_id,
            chunks=tuple(digests),
            written_at=datetime.now(UTC),
        )
        if create_exclusive(self.fs, manifest_path, manifest_bytes(manifest)):
            self._known[k] = manifest
            return manifest
        existing = self._read_shard_manifest(k)
        assert existing is not None, "exclusive create failed but no manifest is there"
        return self._adopt(k, existing, {(d.array, d.index): d.sha256 for d in digests})

    def _adopt(self, k: int, existing: ShardManifest, ours: dict) -> ShardManifest:
        theirs = {(d.array, d.index): d.sha256 for d in existing.chunks}
        if theirs != ours:
            bad = sorted(n for (n, i), h in ours.items() if theirs.get((n, i)) != h)
            raise ShardConflictError(
                f"shard {k} of {self.dir_uri} was recorded by attempt {existing.attempt_id} with "
                f"different bytes (arrays {bad}); this writer's later shards would not extend the "
                "recorded state: reopen with resume=True and read the recorded shards back"
            )
        self._known[k] = existing
        return existing

    def _payloads(self, k, token_slices, checkpoints, initial_checkpoints) -> list[ChunkPayload]:
        start, end = self.layout.shard_range(k)
        token_specs = [a for a in self.layout.arrays if a.kind == "token"]
        ckpt_specs = [a for a in self.layout.arrays if a.kind == "checkpoint"]
        _check_names("token_slices", token_slices, token_specs)
        _check_names("checkpoints", checkpoints, ckpt_specs)
        if ckpt_specs and (k == 0) != (initial_checkpoints is not None):
            raise ValueError(
                "initial_checkpoints (the state at the start of shard 0) go with shard 0 and only "
                f"with it; got k={k} and initial_checkpoints={'set' if initial_checkpoints else None}"
            )
        if k == 0 and ckpt_specs:
            _check_names("initial_checkpoints", initial_checkpoints, ckpt_specs)
        payloads = []
        st = self.layout.shard_tokens
        for a in token_specs:
            t = token_slices[a.name]
            want = (a.shape[0], end - start, *a.shape[2:])
            if tuple(t.shape) != want:
                raise ValueError(
                    f"token_slices[{a.name!r}]: shape {tuple(t.shape)}, shard {k} needs {want}"
                )
            block = tensor_to_stored(t, a)
            payloads += [
                ChunkPayload(a.name, i, p, n) for i, p, n in split_layer_chunks(a, block, k, st)
            ]
        for a in ckpt_specs:
            entries = [(k + 1, checkpoints[a.name])]
            if k == 0:
                entries.insert(0, (0, initial_checkpoints[a.name]))
            for s, t in entries:
                want = (a.shape[0], *a.shape[2:])
                if tuple(t.shape) != want:
                    raise ValueError(
                        f"checkpoint {a.name!r} index {s}: shape {tuple(t.shape)}, need {want}"
                    )
                block = tensor_to_stored(t, a)[:, None]
                payloads += [
                    ChunkPayload(a.name, i, p, n) for i, p, n in split_layer_chunks(a, block, s, st)
                ]
        return payloads

    # ---------------------------------------------------------------- reading back (resume)
    def read_shard(self, k: int, *, verify: bool = True) -> ShardData:
        """Shard k as recorded (by any attempt), checked against its manifest's sha256."""
        manifest = self._known.get(k) or self._read_shard_manifest(k)
        if manifest is None:
            raise ValueError(
                f"shard {k} has no manifest in {self.dir_uri}; completed: {self.completed_shards()}"
            )
        zarr_path = f"{self.dir_path}/{attempt_dir_name(manifest.attempt_id)}/{ZARR_NAME}"
        arrays: dict[tuple[str, int], np.ndarray] = {}
        start, end = manifest.token_start, manifest.token_end
        for a in self.layout.arrays:
            along = (
                [0, k + 1]
                if (a.kind == "checkpoint" and k == 0)
                else [k + 1]
                if a.kind == "checkpoint"
                else [k]
            )
            for j in along:
                n = end - start if a.kind == "token" else 1
                arrays[(a.name, j)] = empty_stored(a, (a.shape[0], n, *a.shape[2:]))

        def load(d):
            a = self.layout.array(d.array)
            data = read_chunk(self.fs, zarr_path, d, verify)
            chunk = np.frombuffer(data, dtype=a.stored_dtype).reshape(
                a.chunk_shape(self.layout.shard_tokens)
            )
            rl, ra = chunk_region(a, self.layout.shard_tokens, d.index)
            arrays[(d.array, d.index[1])][rl] = chunk[: rl.stop - rl.start, : ra.stop - ra.start]

        for_each_chunk(self._pool, load, manifest.chunks)
        self._known[k] = manifest
        tokens, ends, initial = {}, {}, {}
        for a in self.layout.arrays:
            if a.kind == "token":
                tokens[a.name] = stored_to_tensor(arrays[(a.name, k)], a)
            else:
                ends[a.name] = stored_to_tensor(arrays[(a.name, k + 1)][:, 0], a)
                if k == 0:
                    initial[a.name] = stored_to_tensor(arrays[(a.name, 0)][:, 0], a)
        return ShardData(tokens, ends, initial if k == 0 else None)

    # ---------------------------------------------------------------- commit
    def commit(
        self,
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
        cache: CommittedStateLRU | None = default_state_lru,
    ) -> PrefixStateRef:
        """Verify every shard and chunk, then create COMMITTED.json exclusively.

        tensors: optionally the full in-memory state (name -> [L, T, ...] / [L, S+1, ...]); it is put
        in `cache` under the returned ref so that reading it back in this process costs no I/O.
        """
        ref = self.existing_commit()
        if ref is None:
            ref = self._commit_new()
        if tensors is not None and cache is not None:
            cache.put(ref, self.layout, dict(tensors))
        return ref

    def _commit_new(self) -> PrefixStateRef:
        shards = []
        missing = []
        for k in range(self.layout.num_shards):
            m = self._known.get(k) or self._read_shard_manifest(k)
            if m is None:
                missing.append(k)
            else:
                shards.append(m)
        if missing:
            raise ValueError(f"cannot commit {self.dir_uri}: shards {missing} have no manifest yet")
        self._verify_chunks_present(shards)
        manifest = StateManifest(
            key=self.key,
            weights_digest=self.key.weights_digest,
            policy_version=self.key.policy_version,
            prompt_digest=self.key.prompt_digest,
            num_tokens=self.layout.num_tokens,
            shard_tokens=self.layout.shard_tokens,
            attempt_id=self.attempt_id,
            layout=self.layout,
            shards=tuple(shards),
            code_version=longstraw.__version__,
            created_at=datetime.now(UTC),
        )
        data = manifest_bytes(manifest)
        if create_exclusive(self.fs, f"{self.dir_path}/{COMMITTED_NAME}", data):
            return _ref_for(self.dir_uri, manifest, data)
        ref = self.existing_commit()
        assert ref is not None, "exclusive create of COMMITTED.json failed but none is there"
        return ref

    def _verify_chunks_present(self, shards: list[ShardManifest]) -> None:
        expected = {}
        for m in shards:
            base = f"{self.dir_path}/{attempt_dir_name(m.attempt_id)}/{ZARR_NAME}"
            for d in m.chunks:
                expected[f"{base}/{chunk_key(d.array, d.index)}"] = d
        sizes = object_sizes(self.fs, list(expected))
        for (path, d), size in zip(expected.items(), sizes, strict=True):
            if size != d.nbytes:
                raise StateIntegrityError(
                    f"cannot commit: array {d.array!r} chunk {d.index} is "
                    f"{'missing' if size is None else f'{size} bytes'} at {path} (manifest: {d.nbytes})"
                )

    def _check_same_state(self, manifest: StateManifest) -> None:
        if manifest.key != self.key or manifest.layout != self.layout:
            raise StateKeyMismatchError(
                f"{self.dir_uri} is committed for key {manifest.key} / another layout; this writer "
                f"has key {self.key}: the prompt digest must cover everything that changes the state"
            )

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> StateWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_names(what: str, given: Mapping | None, specs) -> None:
    want = {a.name for a in specs}
    got = set(given or {})
    if got != want:
        raise ValueError(
            f"{what}: got arrays {sorted(got)}, the layout needs exactly {sorted(want)}"
        )


def _ref_for(dir_uri: str, manifest: StateManifest, data: bytes) -> PrefixStateRef:
    return PrefixStateRef(
        uri=dir_uri,
        manifest_sha256=sha256_hex(data),
        policy_version=manifest.policy_version,
        weights_digest=manifest.weights_digest,
        prompt_digest=manifest.prompt_digest,
        num_tokens=manifest.num_tokens,
    )


def open_state_writer(
    config: StorageConfig, key: StateKey, layout: StateLayout, *, resume: bool = False
) -> StateWriter:
    """A synchronous StateWriter for `key` (wrap it in BackgroundStateWriter to overlap compute)."""
    return StateWriter(config, key, layout, resume=resume)
