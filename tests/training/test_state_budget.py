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
from longstraw.training import persisted_prefill
from longstraw.training.loop import train
from tests.training.helpers import algorithm_fields, run_config

# The kernels' prefix chunk for both runs: the 63 state tokens are 6 chunks (5 × 12 + 3).
CHUNK_TOKENS = 12
STATE_FIELDS = {"state_peak_resident_bytes", "state_bytes_read", "state_bytes_written"}


@pytest.fixture
def tier_calls(monkeypatch):
    """Every tiered prompt state, as (how it was made, exact mode?, its store), in order, and
    per store the largest peak of any stage (a stage counts its figures from its start)."""
    calls, peaks = [], {}
    tier, allocate = state_tiers.tier_state, state_tiers.allocate_tiered_state
    start_counting = state_tiers.TieredStore.start_counting

    def tiered_copy(model, state, **kwargs):
        tiered = tier(model, state, **kwargs)
        calls.append(("copy", kwargs["exact"], tiered.store))
        return tiered

    def tiered_from_prefill(model, prompt_ids, shard_tokens, budget, **placement):
        tiered = allocate(model, prompt_ids, shard_tokens, budget, **placement)
        calls.append(("prefill", budget.exact, tiered.store))
        return tiered

    def counting(store):
        peaks[id(store)] = max(peaks.get(id(store), 0), store.peak_resident_bytes)
        start_counting(store)

    monkeypatch.setattr(state_tiers, "tier_state", tiered_copy)
    monkeypatch.setattr(persisted_prefill, "allocate_tiered_state", tiered_from_prefill)
    monkeypatch.setattr(state_tiers.TieredStore, "start_counting", counting)
    monkeypatch.setattr(attention, "PREFIX_CHUNK_TOKENS", CHUNK_TOKENS)
    return calls, peaks


def _stage_records(config) -> dict[str, object]:
    step = artifacts.step_dir(config.storage, config.run_id, 0)
    out = {}
    for path in sorted(step.glob("*.json")):
        record = json.loads(path.read_text())
        if path.name.startswith("rollout-"):
            record = {k: record[k] for k in ("response_ids", "sampler_logprobs", "rewards")}
        out[path.name] = record
    return out


@pytest.mark.parametrize("persist_mode", ["off", "synchronous"])
def test_rollout_scoring_and_backward_stream_under_the_budget_bitwise(
    tmp_path, checkpoint_dir, tier_calls, persist_mode
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
            persist_mode=persist_mode,
        )
        outcome = train(config)
        runs[label] = (outcome.history[0], _stage_records(config))
        assert not list(scratch.iterdir()), "scratch files left behind"
    # The policy's states are tiered from their prefill (two groups at policy version 0, then
    # again at version 1 for the second iteration: the state of the weights it differentiates),
    # exact mode keeping their cotangents in the tier. The reference states (scored without a
    # cotangent) are tiered from their prefill too when storage holds them; without
    # persistence the run keeps them resident and they are tiered for their stage.
    calls, peaks = tier_calls
    prefills = [exact for how, exact, _ in calls if how == "prefill"]
    copies = [exact for how, exact, _ in calls if how == "copy"]
    if persist_mode == "off":
        assert prefills == [True] * 4 and copies == [False] * 2, calls
    else:
        assert sorted(prefills) == [False] * 2 + [True] * 4 and copies == [], calls
    (resident, resident_records), (budgeted, budgeted_records) = runs["resident"], runs["budgeted"]
    # The stages' records, and the step's completions table built from them.
    names = {name.split("-")[0] for name in resident_records}
    assert names == {"rollout", "scores", "completions.json"}
    assert budgeted_records == resident_records
    assert {k: v for k, v in algorithm_fields(budgeted).items() if k not in STATE_FIELDS} == {
        k: v for k, v in algorithm_fields(resident).items() if k not in STATE_FIELDS
    }
    assert resident.state_peak_resident_bytes is None
    assert resident.state_bytes_read == resident.state_bytes_written == 0
    stores = [store for _, _, store in calls]
    for store in stores:
        # Budget 0: one working chunk of every array and one prefetched, never a whole layer,
        # in every stage and in the prefill that wrote the state.
        peak = max(peaks.get(id(store), 0), store.peak_resident_bytes)
        assert 0 < peak <= 2 * store.chunk_unit_bytes
        assert peak < max(store.unit_bytes.values())
    assert 0 < budgeted.state_peak_resident_bytes <= max(2 * s.chunk_unit_bytes for s in stores)
    assert budgeted.state_bytes_read > 0 and budgeted.state_bytes_written > 0
