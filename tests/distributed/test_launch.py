"""A rank that raises or dies makes the whole call fail with its rank and traceback, no hang."""

from __future__ import annotations

import time

import pytest
from _workers import die_during_prefill, raise_on_rank

import longstraw.distributed.exchange
import longstraw.models.checkpoint  # noqa: F401
from longstraw.distributed.launch import RankFailedError, run_on_ranks

# Every test here launches ranks (`run_on_ranks`).
pytestmark = pytest.mark.processes


def test_rank_exception_fails_the_call_with_rank_and_traceback():
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(raise_on_rank, 2, 1, timeout_s=60, start_method="fork")
    assert failure.value.rank == 1
    assert "injected failure on rank 1" in failure.value.detail


def test_rank_dying_mid_prefill_fails_the_call_promptly(checkpoint_dir):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(
            die_during_prefill,
            2,
            str(checkpoint_dir("llama")),
            0,
            timeout_s=90,
            start_method="fork",
        )
    elapsed = time.monotonic() - started
    assert failure.value.rank == 0, failure.value.detail
    assert "exited with code 17" in failure.value.detail
    # Well before the 90 s timeout: the parent noticed the exit code, not a collective timeout.
    assert elapsed < 30, f"took {elapsed:.1f} s"


def test_spawned_ranks_return_their_results_in_rank_order():
    # The default start method (spawn, as on GPUs) end to end once.
    assert run_on_ranks(raise_on_rank, 2, -1, timeout_s=120) == [0, 1]
