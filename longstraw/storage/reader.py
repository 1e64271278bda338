"""Read a committed prompt state. Readers only ever go through COMMITTED.json."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zarr

from longstraw.schemas.storage import PrefixStateRef, StateLayout, StateManifest, StorageConfig
from longstraw.storage.cache import CommittedStateLRU, default_state_lru
from longstraw.storage.chunks import for_each_chunk, make_pool, read_chunk, read_chunk_into_local
from longstraw.storage.codec import chunk_key, empty_stored, sha256_hex, stored_to_tensor
from longstraw.storage.errors import (
    StateIntegrityError,
    StateKeyMismatchError,
    StateNotCommittedError,
)
from longstraw.storage.layout_io import chunk_region, chunk_segments, place_chunk, zarr_store
from longstraw.storage.paths import (
    COMMITTED_NAME,
    ZARR_NAME,
    attempt_dir_name,
    filesystem,
    is_local,
)


@dataclass(frozen=True)
class CommittedState:
    tensors: dict[str, torch.Tensor]
    """name -> [L, T, ...] token arrays and [L, S+1, ...] checkpoint arrays, logical dtypes, CPU."""
    layout: StateLayout
    manifest: StateManifest | None
    """None when served from the process cache."""
    ref: PrefixStateRef


def _dir_uri(ref_or_uri: PrefixStateRef | str) -> str:
    uri = ref_or_uri.uri if isinstance(ref_or_uri, PrefixStateRef) else ref_or_uri
    uri = uri.rstrip("/")
    if uri.endswith("/" + COMMITTED_NAME):
        uri = uri[: -len(COMMITTED_NAME) - 1]
    if "://" not in uri:
        uri = StorageConfig(root_uri=uri).root_uri
    return uri


def read_manifest(
    ref_or_uri: PrefixStateRef | str, config: StorageConfig | None = None
) -> tuple[StateManifest, PrefixStateRef]:
    """COMMITTED.json of a state directory, and the ref for it (digest of the exact bytes)."""
    dir_uri = _dir_uri(ref_or_uri)
    fs, dir_path = filesystem(dir_uri, config)
    try:
        data = fs.cat_file(f"{dir_path}/{COMMITTED_NAME}")
    except FileNotFoundError:
        raise StateNotCommittedError(
            f"no committed state at {dir_uri} ({COMMITTED_NAME} missing): the writer never "
            "committed (crashed or still running); resume the prefill with resume=True"
        ) from None
    digest = sha256_hex(data)
    if isinstance(ref_or_uri, PrefixStateRef) and ref_or_uri.manifest_sha256 != digest:
        raise StateIntegrityError(
            f"{dir_uri}/{COMMITTED_NAME} has sha256 {digest}, the ref says {ref_or_uri.manifest_sha256}"
        )
    manifest = StateManifest.model_validate_json(data)
    ref = PrefixStateRef(
        uri=dir_uri,
        manifest_sha256=digest,
        policy_version=manifest.policy_version,
        weights_digest=manifest.weights_digest,
        prompt_digest=manifest.prompt_digest,
        num_tokens=manifest.num_tokens,
    )
    return manifest, ref


def _check_expected(ref: PrefixStateRef, weights_digest: str, policy_version: int | None) -> None:
    if ref.weights_digest != weights_digest or ref.policy_version != policy_version:
        raise StateKeyMismatchError(
            f"state {ref.uri} was computed with weights {ref.weights_digest} at policy version "
            f"{ref.policy_version}; expected weights {weights_digest} at version {policy_version}. "
            "A state is only valid for the weights that computed it: recompute the prefill."
        )


def open_committed_state(
    ref_or_uri: PrefixStateRef | str,
    *,
    expect_weights_digest: str,
    expect_policy_version: int | None,
    verify_checksums: bool = True,
    cache: CommittedStateLRU | None = default_state_lru,
    config: StorageConfig | None = None,
) -> CommittedState:
    """The full state of a committed prefix, checked against the expected weights and version.

    expect_policy_version: None for a reference-model state. Every chunk's sha256 is checked
    unless verify_checksums=False. A ref whose digest is in `cache` is served from memory.
    """
    if isinstance(ref_or_uri, PrefixStateRef) and cache is not None:
        hit = cache.get(ref_or_uri.manifest_sha256)
        if hit is not None:
            _check_expected(hit.ref, expect_weights_digest, expect_policy_version)
            return CommittedState(hit.tensors, hit.layout, None, hit.ref)
    manifest, ref = read_manifest(ref_or_uri, config)
    _check_expected(ref, expect_weights_digest, expect_policy_version)
    tensors = read_state_arrays(manifest, ref.uri, verify_checksums, config)
    return CommittedState(tensors, manifest.layout, manifest, ref)


def read_state_arrays(
    manifest: StateManifest, dir_uri: str, verify: bool = True, config: StorageConfig | None = None
) -> dict[str, torch.Tensor]:
    """Every chunk named by the manifest, read (and hashed) in parallel into full arrays."""
    layout = manifest.layout
    fs, dir_path = filesystem(dir_uri, config)
    out = {a.name: empty_stored(a) for a in layout.arrays}
    jobs = [
        (f"{dir_path}/{attempt_dir_name(m.attempt_id)}/{ZARR_NAME}", d)
        for m in manifest.shards
        for d in m.chunks
    ]

    local = is_local(fs)

    def load(job):
        zarr_path, d = job
        a = layout.array(d.array)
        if local:
            path = f"{zarr_path}/{chunk_key(d.array, d.index)}"
            read_chunk_into_local(
                path, d, chunk_segments(out[d.array], a, layout.shard_tokens, d.index), verify
            )
        else:
            place_chunk(
                out[d.array], a, layout.shard_tokens, d, read_chunk(fs, zarr_path, d, verify)
            )

    pool = make_pool()
    try:
        for_each_chunk(pool, load, jobs)
    finally:
        pool.shutdown(wait=True)
    return {a.name: stored_to_tensor(out[a.name], a) for a in layout.arrays}


def verify_state(
    ref_or_uri: PrefixStateRef | str, config: StorageConfig | None = None
) -> StateManifest:
    """Read every chunk of a committed state and check its sha256; raises on the first bad one."""
    manifest, ref = read_manifest(ref_or_uri, config)
    read_state_arrays(manifest, ref.uri, verify=True, config=config)
    return manifest


def naive_read_committed_state(
    ref_or_uri: PrefixStateRef | str, config: StorageConfig | None = None
) -> dict[str, torch.Tensor]:
    """Reference reader: zarr's own API, region by region from each shard's attempt (no hashing)."""
    manifest, ref = read_manifest(ref_or_uri, config)
    layout = manifest.layout
    out = {a.name: np.empty(a.shape, dtype=a.stored_dtype) for a in layout.arrays}
    for m in manifest.shards:
        group = zarr.open_group(
            store=zarr_store(f"{ref.uri}/{attempt_dir_name(m.attempt_id)}/{ZARR_NAME}", config),
            mode="r",
        )
        for d in m.chunks:
            a = layout.array(d.array)
            rl, ra = chunk_region(a, layout.shard_tokens, d.index)
            out[d.array][rl, ra] = group[d.array][rl, ra]
    return {a.name: stored_to_tensor(out[a.name], a) for a in layout.arrays}
