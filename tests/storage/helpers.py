"""A small synthetic prompt state (the engine's arrays, tiny) and the writing loop the engine runs."""

from __future__ import annotations

import torch

from longstraw.schemas.storage import ArraySpec, StateLayout
from longstraw.storage.writer import StateWriter

# Odd sizes on purpose: 63 tokens in shards of 16 leave a last shard of 15; 3 layers in chunks of 2
# leave an edge chunk along layers too.
NUM_TOKENS = 63
SHARD_TOKENS = 16

BUCKET = "longstraw-tests"
"""The loopback S3 server's bucket (conftest's `s3_server`); here, not in conftest, since another
folder's conftest may be the module named `conftest` when several folders are collected."""


def make_layout(
    dtype: str = "float32", num_tokens: int = NUM_TOKENS, shard_tokens: int = SHARD_TOKENS
) -> StateLayout:
    num_shards = -(-num_tokens // shard_tokens)
    return StateLayout.build(
        [
            ArraySpec(
                name="full_attention/k",
                kind="token",
                shape=(3, num_tokens, 2, 8),
                dtype=dtype,
                layers_per_chunk=2,
            ),
            ArraySpec(
                name="full_attention/v", kind="token", shape=(3, num_tokens, 2, 8), dtype=dtype
            ),
            ArraySpec(name="mla/latent", kind="token", shape=(1, num_tokens, 12), dtype=dtype),
            ArraySpec(
                name="linear_attention/recurrent",
                kind="checkpoint",
                shape=(2, num_shards + 1, 2, 4, 4),
                dtype="float32",
            ),
            ArraySpec(
                name="linear_attention/conv",
                kind="checkpoint",
                shape=(2, num_shards + 1, 6, 3),
                dtype=dtype,
            ),
        ],
        num_tokens=num_tokens,
        shard_tokens=shard_tokens,
    )


def make_state(layout: StateLayout, seed: int = 42) -> dict[str, torch.Tensor]:
    """Full arrays as the engine would hold them; checkpoint index 0 (initial state) is zeros."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for a in layout.arrays:
        t = torch.randn(a.shape, generator=g, dtype=torch.float32)
        if a.kind == "checkpoint":
            t[:, 0] = 0
        out[a.name] = t.to(getattr(torch, a.dtype))
    return out


def shard_args(layout: StateLayout, state: dict[str, torch.Tensor], k: int):
    start, end = layout.shard_range(k)
    tokens = {a.name: state[a.name][:, start:end] for a in layout.arrays if a.kind == "token"}
    ckpts = {a.name: state[a.name][:, k + 1] for a in layout.arrays if a.kind == "checkpoint"}
    initial = (
        {a.name: state[a.name][:, 0] for a in layout.arrays if a.kind == "checkpoint"}
        if k == 0
        else None
    )
    return tokens, ckpts, initial


def run_prefill(
    writer: StateWriter, layout: StateLayout, state: dict[str, torch.Tensor]
) -> list[int]:
    """The engine's loop: read back completed shards (resume), write the rest. Returns shards written."""
    done = set(writer.completed_shards())
    written = []
    for k in range(layout.num_shards):
        if k in done:
            back = writer.read_shard(k)
            start, end = layout.shard_range(k)
            for name, t in back.token_slices.items():
                assert torch.equal(t, state[name][:, start:end]), (
                    f"shard {k} {name} read back differs"
                )
            continue
        writer.write_shard(k, *shard_args(layout, state, k))
        written.append(k)
    return written


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, shapes, dtypes and bits; prints max_diff/mean_diff of the first mismatch."""
    assert set(got) == set(want), f"arrays {sorted(got)} != {sorted(want)}"
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{name}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        )
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]
        if not torch.equal(g.contiguous().view(ints), w.contiguous().view(ints)):
            diff = (g.float() - w.float()).abs()
            raise AssertionError(
                f"{name}: bits differ, max_diff={diff.max():.3e} mean_diff={diff.mean():.3e}"
            )
