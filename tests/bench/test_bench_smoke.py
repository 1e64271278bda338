"""Smoke runs of every benchmark on the tiny Qwen3.5 checkpoint: fields present, numbers sane.

No wall-clock assertions: the machine is shared. The methods run in-process here (seconds); the
isolation machinery (own process, caps recorded as statuses) is tested with one short run and
with a memory cap every run exceeds.
"""

from __future__ import annotations

import pytest
import torch

from bench.grpo import methods, suites
from bench.grpo.runner import run_isolated
from bench.grpo.worker import run_method
from bench.grpo.workload import BenchSpec, build_batch, response_lengths

_MIB = 2**20


@pytest.fixture(scope="module")
def tiny(checkpoint_dir):
    from transformers import AutoModelForCausalLM

    path = str(checkpoint_dir("qwen3_5"))
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    return path, model


def test_batch_has_unequal_response_lengths_and_zero_mean_advantages(tiny):
    spec = BenchSpec(method="longstraw-exact", checkpoint=tiny[0], prompt_tokens=63, group_size=8)
    batch = build_batch(spec, vocab_size=512)
    lengths = [r.numel() for r in batch.responses]
    assert lengths == response_lengths(spec)
    assert len(set(lengths)) > 1, lengths
    assert all(27 <= n <= 37 for n in lengths), lengths
    assert abs(float(batch.advantages.sum())) < 1e-5, batch.advantages


@pytest.mark.parametrize(
    "method", ["longstraw-exact", "longstraw-detached", "full-sequence", "prefill", "hf-forward"]
)
def test_each_method_reports_a_positive_step_time(tiny, method, tmp_path):
    path, model = tiny
    spec = BenchSpec(
        method=method,
        checkpoint=path,
        prompt_tokens=63,
        group_size=3,
        response_tokens=7,
        shard_tokens=10,
        measured_sequences=1,
    )
    result = run_method(model, spec, str(tmp_path))
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_disable()
    model.eval()
    assert result["step_s"] > 0, result
    if method.startswith("longstraw"):
        assert result["state_bytes"] == methods.kv_fp32_bytes(model, 63), result
        assert (result["cotangent_bytes"] > 0) == (method == "longstraw-exact"), result
    if method == "full-sequence":
        assert result["step_s_scaled"] and result["step_s"] == pytest.approx(
            3 * result["measured_s"]
        ), result
    if method in ("prefill", "hf-forward"):
        assert result["tokens_per_s"] > 0, result


def test_rollout_and_decode_steps_report_their_stages(tiny, tmp_path):
    path, model = tiny
    spec = BenchSpec(
        method="rollout", checkpoint=path, prompt_tokens=63, group_size=3, response_tokens=5
    )
    result = run_method(model, spec, str(tmp_path))
    assert result["step_s"] == pytest.approx(result["prefill_s"] + result["sampling_s"]), result
    assert result["decode_step_s"] == pytest.approx(result["sampling_s"] / 5), result
    spec = spec.model_copy(
        update={
            "method": "decode-steps",
            "decode_group_sizes": (1, 2),
            "decode_repeats": 2,
            "decode_reference_tokens": 17,
        }
    )
    result = run_method(model, spec, str(tmp_path))
    assert sorted(result["decode_step_s"]) == [1, 2], result
    assert all(len(r) == 2 for r in result["decode_step_runs_s"].values()), result
    assert all(s > 0 for s in result["decode_step_s"].values()), result
    assert result["reference_tokens"] == 17 and sorted(result["ratio_to_reference"]) == [1, 2]


def test_fidelity_puts_exact_full_sequence_and_trl_on_the_reference_and_detached_off_it(
    tiny, tmp_path
):
    path, model = tiny
    spec = BenchSpec(
        method="fidelity",
        checkpoint=path,
        prompt_tokens=63,
        group_size=3,
        response_tokens=7,
        shard_tokens=10,
    )
    rows = run_method(model, spec, str(tmp_path))["methods"]
    model.gradient_checkpointing_disable()
    for name in ("longstraw-exact", "full-sequence", "trl"):
        if "skipped" in rows[name]:
            assert name == "trl", rows[name]
            continue
        # Measured: relative error 3e-8 .. 3e-7 (fp32 reordering over ~200K parameters).
        assert rows[name]["relative_error"] < 1e-5, (name, rows[name])
        assert rows[name]["cosine"] > 1 - 1e-8, (name, rows[name])
    # Detached drops the gradient through the prompt state: visibly off, still correlated.
    assert 0.3 < rows["longstraw-detached"]["cosine"] < 0.9999, rows["longstraw-detached"]
    assert rows["longstraw-detached"]["relative_error"] > 1e-3, rows["longstraw-detached"]


def test_naive_group_gradient_takes_a_runs_loss_settings(tiny):
    """The reference gradient under another loss than TRL's defaults is the exact-mode engine
    gradient under that loss, and not the default loss's gradient."""
    from longstraw.engine.group import accumulate_group_gradients
    from longstraw.schemas.grpo import GRPOConfig
    from longstraw.schemas.run import EngineConfig

    _, model = tiny
    spec = BenchSpec(method="fidelity", checkpoint=tiny[0], prompt_tokens=63, group_size=3,
                     response_tokens=7)  # fmt: skip
    batch = build_batch(spec, vocab_size=512)
    config = GRPOConfig(loss_type="grpo", num_generations=3, max_completion_length=12)
    reference, _ = methods.naive_group_gradient(model, batch, config)
    default, _ = methods.naive_group_gradient(model, batch)
    accumulate_group_gradients(model, batch.prompt_ids, batch.responses, batch.advantages,
                               config, EngineConfig(shard_tokens=10, prompt_grad="exact"))  # fmt: skip
    engine = methods.flat_grad(model)
    # Measured: relative error ~1e-7 (fp32 reordering), as the fidelity test's exact row.
    assert methods.compare(engine, reference)["relative_error"] < 1e-5
    assert methods.compare(default, reference)["relative_error"] > 1e-2


@pytest.mark.processes
def test_isolated_run_reports_its_own_peak_rss(tiny):
    spec = BenchSpec(method="prefill", checkpoint=tiny[0], prompt_tokens=63, shard_tokens=10)
    record = run_isolated(spec, time_cap_s=300, mem_cap_bytes=8 * 2**30)
    assert record["status"] == "ok", record.get("error")
    result = record["result"]
    assert result["peak_rss_bytes"] >= result["baseline_rss_bytes"] > 50 * _MIB, result
    assert result["tokens_per_s"] > 0 and result["spec"]["prompt_tokens"] == 63, result
    assert record["observed_peak_rss_bytes"] > 0, record


@pytest.mark.processes
def test_runs_over_the_memory_cap_are_recorded_as_oom_and_later_lengths_as_skipped(tiny):
    # Every Python process with torch imported passes 20 MiB: the first run is killed at once.
    data = suites.context_suite(
        tiny[0],
        prompt_lengths=[63, 127],
        group_size=2,
        methods=["longstraw-detached"],
        shard_tokens=10,
        time_cap_s=300,
        mem_cap_bytes=20 * _MIB,
        progress=lambda _: None,
    )
    statuses = [r["status"] for r in data["runs"]]
    assert statuses == ["oom", "skipped"], statuses
    assert data["runs"][0]["observed_peak_rss_bytes"] > 20 * _MIB, data["runs"][0]
    assert "P=63" in data["runs"][1]["reason"], data["runs"][1]
    reach = data["summary"]["reachable"]["longstraw-detached"]
    assert reach == {"max_ok_prompt_tokens": None, "stopped_by": "oom", "stop_reason": None}
