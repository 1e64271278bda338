"""`engine.state_budget_bytes` in `longstraw train`: rollout, scoring and backward all stream the
prompt state, and the run is bitwise the resident one.

Reference: the same run with the state resident (no budget). Same kernels on the same chunk grid,
so sampled tokens, sampler / reference / old log-probs and the step's loss, KL and gradient norm
must be equal, not close.
"""

from __future__ import annotations

import json

import pytest

from longstraw.engine import attention, state_tiers
from longstraw.storage import artifacts
from longstraw.training.loop import train
from tests.training.helpers import algorithm_fields, run_config

# The kernels' prefix chunk for both runs: the 63 state tokens are 6 chunks (5 × 12 + 3).
CHUNK_TOKENS = 12
STATE_FIELDS = {"state_peak_resident_bytes", "state_bytes_read", "state_bytes_written"}


@pytest.fixture
def tier_calls(monkeypatch):
    """Every tiering of a prompt state, as (exact mode?, its store), in order."""
    calls = []
    original = state_tiers.tier_state

    def counting(model, state, **kwargs):
        tiered = original(model, state, **kwargs)
        calls.append((kwargs["exact"], tiered.store))
        return tiered

    monkeypatch.setattr(state_tiers, "tier_state", counting)
    monkeypatch.setattr(attention, "PREFIX_CHUNK_TOKENS", CHUNK_TOKENS)
    return calls


def _stage_records(config) -> dict[str, object]:
    step = artifacts.step_dir(config.storage, config.run_id, 0)
    out = {}
    for path in sorted(step.glob("*.json")):
        record = json.loads(path.read_text())
        if path.name.startswith("rollout-"):
            record = {k: record[k] for k in ("response_ids", "sampler_logprobs", "rewards")}
        out[path.name] = record
    return out


def test_rollout_scoring_and_backward_stream_under_the_budget_bitwise(
    tmp_path, checkpoint_dir, tier_calls
):
    runs = {}
    for label, budget in (("resident", None), ("budgeted", 0)):
        scratch = tmp_path / f"scratch-{label}"
        scratch.mkdir()
        config = run_config(
            tmp_path / label,
            checkpoint_dir("qwen3_5"),
            num_steps=1,
            # beta > 0: reference scores; two iterations: the rollout policy's ("old") scores.
            grpo={"beta": 0.04, "num_iterations": 2},
            engine={"state_budget_bytes": budget, "state_tier": "disk", "state_dir": str(scratch)},
        )
        outcome = train(config)
        runs[label] = (outcome.history[0], _stage_records(config))
        assert not list(scratch.iterdir()), "scratch files left behind"
    # Two groups: rollout, reference and old scores without a cotangent (2 each), then the
    # exact-mode backward of each group in each of the two iterations.
    assert [exact for exact, _ in tier_calls] == [False] * 6 + [True] * 4
    (resident, resident_records), (budgeted, budgeted_records) = runs["resident"], runs["budgeted"]
    assert {name.split("-")[0] for name in resident_records} == {"rollout", "scores"}
    assert budgeted_records == resident_records
    assert {k: v for k, v in algorithm_fields(budgeted).items() if k not in STATE_FIELDS} == {
        k: v for k, v in algorithm_fields(resident).items() if k not in STATE_FIELDS
    }
    assert resident.state_peak_resident_bytes is None
    assert resident.state_bytes_read == resident.state_bytes_written == 0
    stores = [store for _, store in tier_calls]
    for store in stores:
        # Budget 0: one working chunk of every array and one prefetched, never a whole layer.
        assert 0 < store.peak_resident_bytes <= 2 * store.chunk_unit_bytes
        assert store.peak_resident_bytes < max(store.unit_bytes.values())
    assert budgeted.state_peak_resident_bytes == max(s.peak_resident_bytes for s in stores)
    assert budgeted.state_bytes_read == sum(s.bytes_read for s in stores)
    assert budgeted.state_bytes_written == sum(s.bytes_written for s in stores) > 0
