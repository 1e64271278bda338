"""Sequence-sharded fp32 gradient accumulators (the engine's `group_gradient` over the ranks) vs
the dense reference (`_group_gradients.dense_group_gradients`).

Same group as test_sharded_engine.py: P = 200 (T = 199) in 33-token shards, 7 shards split 4 + 3
(llama, 2 ranks) and 3 + 2 + 2 (qwen3_5, 3 ranks). On 3 ranks dim 0 = 64 splits 22 + 22 + 20 and
the [4] / [4, 64] parameters 2 + 2 + 0: uneven rows and an empty slice. Each rank's slices must
equal the same rows of the dense reference's result, partition every parameter's rows,
and the step must never allocate a dense fp32 accumulator.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _slice_workers import glm_slices, slices_against_dense

import longstraw.distributed.exchange
import longstraw.engine.group
import longstraw.models.checkpoint  # noqa: F401
from longstraw.distributed.gradient_slices import SliceLayout
from longstraw.distributed.launch import run_on_ranks

# Every test here launches ranks (`run_on_ranks`).
pytestmark = pytest.mark.processes

PROMPT_LEN, SHARD_TOKENS = 200, 33
CASES = [("llama", 2), ("qwen3_5", 3)]
MODES = ["detached", "exact"]
# Exact mode: the dense path sums each owner's shards then all-reduces over ranks, the sliced
# path adds the shards in sweep order into one slice: the same terms in another fp32 order.
# Worst per-tensor max_diff / max|ref| measured 2.1e-7; 5x margin.
EXACT_MAX_REL = 1e-6


@functools.cache
def _results(checkpoint: str, world: int, dtype: str = "float32") -> tuple[dict, ...]:
    return tuple(
        run_on_ranks(
            slices_against_dense,
            world,
            checkpoint,
            PROMPT_LEN,
            SHARD_TOKENS,
            dtype,
            timeout_s=240,
            start_method="fork",
        )
    )


@pytest.fixture(params=CASES, ids=[f"{f}-{w}ranks" for f, w in CASES])
def results(request, checkpoint_dir):
    family, world = request.param
    return _results(str(checkpoint_dir(family)), world)


@pytest.mark.parametrize("mode", MODES)
def test_slices_partition_every_parameters_rows_in_chunk_order(results, mode):
    world = len(results)
    for name, dim0 in results[0]["dim0"].items():
        rows = [r[mode]["rows"][name] for r in results]
        chunk = -(-dim0 // world)
        # torch.chunk layout: rank s holds rows [s·c, (s+1)·c) clipped, possibly none.
        assert rows == [max(0, min(dim0, (s + 1) * chunk) - s * chunk) for s in range(world)]
        assert sum(rows) == dim0, name


def test_three_rank_case_has_uneven_and_empty_slices(checkpoint_dir):
    results = _results(str(checkpoint_dir("qwen3_5")), 3)
    rows = [r["exact"]["rows"] for r in results]
    assert any(len({r[n] for r in rows}) > 1 for n in rows[0]), "no uneven split"
    assert any(r[n] == 0 for r in rows for n in r), "no empty slice"


def test_detached_slices_are_bitwise_the_dense_rows(results):
    # No sweep: each slice is rows of the replicated branch gradient, the dense path is that
    # gradient plus zeros from the other ranks — the same bits.
    for rank, r in enumerate(results):
        assert r["detached"]["bitwise"], f"rank {rank}: {r['detached']['max_rel']:.3e}"


def test_exact_slices_match_the_dense_rows(results):
    for rank, r in enumerate(results):
        got = r["exact"]["max_rel"]
        assert got <= EXACT_MAX_REL, f"rank {rank}: max_diff / max|ref| {got:.3e}"


@pytest.mark.parametrize("mode", MODES)
def test_sliced_logprobs_are_the_dense_paths_and_param_grads_untouched(results, mode):
    assert all(r[mode]["logps_equal"] for r in results)
    assert all(r[mode]["grads_untouched"] for r in results)


@pytest.mark.parametrize("mode", MODES)
def test_no_dense_fp32_accumulator_exists_during_the_step(results, mode):
    world = len(results)
    total = results[0]["param_bytes_fp32"]
    # The accumulators of the group add up to ONE copy of the gradient, about 1/N each.
    assert sum(r[mode]["accumulator_bytes"] for r in results) == total
    for rank, r in enumerate(results):
        m = r[mode]
        assert m["accumulator_bytes"] <= total / world * 1.1, f"rank {rank}: {m}"
        # Probe: zero-filled fp32 allocations during each call. Everything but the accumulators
        # is the same in both paths, so the dense path's two dense GradBuffers minus this rank's
        # slices is the whole difference (and it would be 0 if the sliced call were dense).
        difference = m["dense_zero_filled_bytes"] - m["sliced_zero_filled_bytes"]
        assert difference == 2 * total - m["accumulator_bytes"], f"rank {rank}: {m}"


def test_sweep_scatters_only_in_exact_mode_and_every_byte_sent_is_received(results):
    assert all(r["detached"]["scatter_bytes_sent"] == 0 for r in results)
    assert all(r["detached"]["scatter_bytes_received"] == 0 for r in results)
    sent = sum(r["exact"]["scatter_bytes_sent"] for r in results)
    assert sent > 0
    assert sent == sum(r["exact"]["scatter_bytes_received"] for r in results)


def test_bf16_model_slices_match_and_the_sweep_scatters_bf16(checkpoint_dir):
    # A bf16 model: gradients are bf16, accumulators fp32 in both paths; the scatter carries the
    # parameter's dtype, so the sweep sends exactly half the fp32 model's bytes.
    bf16 = _results(str(checkpoint_dir("llama")), 2, "bfloat16")
    fp32 = _results(str(checkpoint_dir("llama")), 2)
    for rank, (r, f) in enumerate(zip(bf16, fp32, strict=True)):
        assert r["detached"]["bitwise"], f"rank {rank}: {r['detached']['max_rel']:.3e}"
        assert r["exact"]["max_rel"] <= EXACT_MAX_REL, f"rank {rank}: {r['exact']['max_rel']:.3e}"
        assert r["exact"]["accumulator_bytes"] == f["exact"]["accumulator_bytes"]
        assert 2 * r["exact"]["scatter_bytes_sent"] == f["exact"]["scatter_bytes_sent"]


def test_glm_slices_match_the_dense_rows_in_both_modes(checkpoint_dir):
    # GLM-5 (P = 100 in 13-token shards over 2 ranks, as test_sharded_glm.py): detached slicing
    # needs nothing from the MLA serve loop; the exact sweep's owner scatters through it.
    results = run_on_ranks(
        glm_slices,
        2,
        str(checkpoint_dir("glm_moe_dsa")),
        100,
        13,
        timeout_s=240,
        start_method="fork",
    )
    for rank, r in enumerate(results):
        assert r["detached"]["bitwise"], f"rank {rank}: {r['detached']['max_rel']:.3e}"
        assert r["exact"]["max_rel"] <= EXACT_MAX_REL, f"rank {rank}: {r['exact']['max_rel']:.3e}"
    sent = sum(r["exact"]["scatter_bytes_sent"] for r in results)
    assert sent > 0 and sent == sum(r["exact"]["scatter_bytes_received"] for r in results)
    assert all(r["detached"]["scatter_bytes_sent"] == 0 for r in results)


@pytest.mark.parametrize("dim0", [1, 4, 32, 63, 64])
@pytest.mark.parametrize(("data", "seq"), [(1, 2), (1, 3), (2, 2), (2, 3), (3, 2)])
def test_slice_layout_pieces_are_fsdp_chunks_of_the_flattened_mesh(dim0, data, seq):
    rows = torch.arange(dim0)
    chunks = torch.chunk(rows, data * seq)
    covered = []
    for s in range(seq):
        layout = SliceLayout(seq_rank=s, seq_size=seq, data_size=data)
        pieces = layout.pieces(dim0)
        assert layout.rows(dim0) <= layout.padded_rows(dim0)
        for d, (start, end) in enumerate(pieces):
            # Piece d of seq rank s is FSDP's chunk of global rank d · N_s + s (or empty).
            g = d * seq + s
            want = chunks[g] if g < len(chunks) else rows[:0]
            assert torch.equal(rows[start:end], want), (s, d, start, end)
            covered.extend(range(start, end))
    assert sorted(covered) == list(range(dim0))
