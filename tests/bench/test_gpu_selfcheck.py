"""The GPU self-check (`bench/gpu_selfcheck.py`) in its `--smoke` mode on the CPU: every section
runs, writes its JSON and markdown, and the sections a CPU can run report real numbers.

One smoke run serves every test of the module (~15 s on one thread), in a process of its own that
sees only the packages the GPU machine's image has or the wheels carry (`not_on_the_gpu_image`).
It runs with one torch thread: on this shared 2-core machine two spinning OpenMP threads made it
20-50x slower (parity of one tiny model 5 s instead of 0.1 s).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def selfcheck(bench_script):
    return bench_script("gpu_selfcheck")


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _distribution_names(path: Path) -> set[str]:
    """Normalised distribution names of a list with one name a line (# comments) or of a
    requirements file's `name==version` lines."""
    names = set()
    for line in path.read_text().splitlines():
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9_.-]*", line)  # not "#", not "    --hash"
        if match:
            names.add(_normalised(match.group(0)))
    return names


def _with_requirements(names: set[str]) -> set[str]:
    """`names` and what their installed versions require, transitively (extras asked for
    included): the image's packages here may be other versions with other requirements."""
    seen, todo = set(), [(name, frozenset()) for name in names]
    while todo:
        name, extras = todo.pop()
        if (_normalised(name), extras) in seen:
            continue
        seen.add((_normalised(name), extras))
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen}


def not_on_the_gpu_image() -> list[str]:
    """Top-level modules installed here whose distributions are neither on the GPU image's list
    (bench/gpu_image_packages.txt), nor carried (bench/gpu_wheels.txt), nor required by either."""
    allowed = _with_requirements(
        _distribution_names(BENCH / "gpu_image_packages.txt")
        | _distribution_names(BENCH / "gpu_wheels.txt")
    )
    return sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not {_normalised(d) for d in dists} & allowed
    )


# The smoke run in a process of its own, as on the GPU image: each module that the image lacks
# is None in sys.modules, so that `import` of it fails and `find_spec` finds nothing (an optional
# import is skipped, a required one fails the run).
_SMOKE_PROCESS = """
import json, sys
for name in {blocked!r}:
    sys.modules[name] = None
import torch
torch.set_num_threads(1)
sys.path.insert(0, {bench!r})
import gpu_selfcheck
returned = gpu_selfcheck.main(["--smoke", "--device", "cpu", "--out", {out!r}])
imported = sorted({{n.split(".")[0] for n, m in sys.modules.items() if m is not None}})
with open({record!r}, "w") as f:
    json.dump({{"sections": list(returned["sections"]), "imported": imported}}, f)
"""


@pytest.fixture(scope="module")
def blocked() -> list[str]:
    return not_on_the_gpu_image()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, blocked):
    out = tmp_path_factory.mktemp("selfcheck")
    record = out / "process.json"
    code = _SMOKE_PROCESS.format(
        blocked=blocked, bench=str(BENCH), out=str(out), record=str(record)
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((out / "gpu_selfcheck.json").read_text())
    process = json.loads(record.read_text())
    returned = {"sections": dict.fromkeys(process["sections"])}
    return report, returned, (out / "gpu_selfcheck.md").read_text(), process["imported"]


def _positive(x) -> bool:
    return isinstance(x, float | int) and math.isfinite(x) and x > 0


@pytest.mark.processes
def test_smoke_writes_every_section_with_status_time_and_budget(smoke, selfcheck):
    report, returned, md, _ = smoke
    assert report["mode"] == "smoke"
    assert list(report["sections"]) == list(selfcheck.SECTIONS)
    for name, section in report["sections"].items():
        assert section["status"] == "ok", (name, section.get("reason"), section.get("traceback"))
        assert 0 < section["seconds"] <= section["budget_s"], (name, section["seconds"])
    assert report["settings_unchanged"] is True
    assert report["torch_flags_before"] == report["torch_flags_after"]
    assert report["sections"].keys() == returned["sections"].keys()
    for heading in ("## Kernels", "## Log-prob parity", "## Exact gradient", "## Scale", "tiers"):
        assert heading in md, heading


@pytest.mark.processes
def test_kernels_section_names_every_gpu_package_and_what_ran(smoke):
    kernels = smoke[0]["sections"]["kernels"]
    by_module = {row["module"]: row for row in kernels["packages"]}
    assert set(by_module) == {"flash_attn", "fla", "causal_conv1d"}
    for module, row in by_module.items():
        assert row["installed"] == (importlib.util.find_spec(module) is not None), row
        if not row["installed"]:
            assert row["import"] == "not installed" and row["version"] is None, row
    bindings = kernels["transformers_bindings"]
    assert "qwen3_5.torch_chunk_gated_delta_rule" in bindings
    if importlib.util.find_spec("fla") is None:
        # Without fla, transformers' wrapper resolves to its own torch function.
        assert bindings["qwen3_5.torch_chunk_gated_delta_rule"].startswith("transformers.models")
    # On a CPU: the CPU flash kernel for the attention partials, LongStraw's chunked rule for
    # the delta-rule recomputation, whatever the installed packages.
    ran = kernels["kernels_ran"]
    assert ran["qwen3_5 float32 full_attention.prefix"] == "aten-cpu-flash", ran
    assert ran["qwen3_5 bfloat16 full_attention.prefix"] == "aten-cpu-flash", ran
    assert ran["qwen3_5 float32 linear_attention.recompute"] == "torch", ran
    assert ran["qwen3_5 float32 full_attention.decode"] == "aten-cpu-flash", ran
    assert not any(k.endswith(" step") for k in ran), ran  # no probe failed
    assert not any(k.startswith("glm_moe_dsa") and "linear_attention" in k for k in ran), ran


@pytest.mark.processes
def test_parity_rows_are_measured_within_tolerance(smoke, selfcheck):
    rows = smoke[0]["sections"]["parity"]["rows"]
    cfg = selfcheck.SMOKE
    assert [(r["family"], r["dtype"]) for r in rows] == [
        (f, d) for f in cfg.families for d in ("float32", "bfloat16")
    ]
    for row in rows:
        assert row["status"] == "ok", row
        assert math.isfinite(row["max_abs_diff"]) and row["max_abs_diff"] >= 0, row
        assert row["max_abs_diff"] <= selfcheck.PARITY_TOL[row["dtype"]], row
    # bf16 rounding shows; fp32 agrees to rounding: the two are distinguishable numbers.
    fp32 = max(r["max_abs_diff"] for r in rows if r["dtype"] == "float32")
    bf16 = max(r["max_abs_diff"] for r in rows if r["dtype"] == "bfloat16")
    assert fp32 < 1e-5 < bf16, (fp32, bf16)


@pytest.mark.processes
def test_exact_gradient_is_judged_against_float64(smoke):
    (row,) = smoke[0]["sections"]["exact_gradient"]["rows"]
    assert row["status"] == "ok", row
    assert _positive(row["worst_rel_error"]) and row["worst_rel_error"] < 1e-4, row
    assert 0 < row["worst_over_bar"] <= 1.0, row
    assert row["worst_parameter"], row


@pytest.mark.processes
def test_scale_rows_time_every_stage_and_skip_device_memory_on_cpu(smoke, selfcheck):
    scale = smoke[0]["sections"]["scale"]
    cfg = selfcheck.SMOKE
    assert [p["prompt_len"] for p in scale["prefill"]] == list(cfg.scale_lengths)
    for prefill in scale["prefill"]:
        assert prefill["status"] == "ok", prefill
        assert _positive(prefill["prefill_tokens_per_s"]) and _positive(prefill["state_bytes"])
        assert prefill["peak_allocated_bytes"] == selfcheck.NO_CUDA
    keys = [(r["prompt_len"], r["prompt_grad"], r["group"]) for r in scale["rows"]]
    assert keys == [
        (p, m, g)
        for p in cfg.scale_lengths
        for m in ("detached", "exact")
        for g in cfg.scale_groups
    ]
    for row in scale["rows"]:
        assert row["status"] == "ok", row
        assert _positive(row["step_s"]) and _positive(row["replay_s"]), row
        assert _positive(row["sweep_s"]) == (row["prompt_grad"] == "exact"), row
        assert (row["cotangent_bytes"] > 0) == (row["prompt_grad"] == "exact"), row
        assert math.isfinite(row["loss"]), row
        assert row["peak_allocated_bytes"] == selfcheck.NO_CUDA
    # Device memory figures need CUDA: no growth row on a CPU.
    assert scale["group_growth"] == []
    assert scale["kernels_ran"]["full_attention.prefix"] == "aten-cpu-flash", scale["kernels_ran"]


def test_command_line_overrides_budgets_and_lengths(selfcheck, tmp_path):
    report = selfcheck.main(
        ["--smoke", "--device", "cpu", "--out", str(tmp_path), "--sections", "scale",
         "--scale-lengths", "17", "--budget", "scale=0"]
    )  # fmt: skip
    assert list(report["config"]["scale_lengths"]) == [17]
    assert report["sections"]["scale"]["budget_s"] == 0.0
    assert report["sections"]["scale"]["status"] == "partial"
    assert report["sections"]["scale"]["prefill"][0]["status"].startswith("skipped: section budget")
    with pytest.raises(SystemExit):
        selfcheck.main(["--smoke", "--out", str(tmp_path), "--budget", "nosuch=1"])


@pytest.mark.processes
def test_tiers_stream_under_a_budget_below_the_state_and_match_resident(smoke):
    resident, tiered = smoke[0]["sections"]["tiers"]["rows"]
    assert resident["config"] == "resident" and resident["status"] == "ok", resident
    assert tiered["status"] == "ok", tiered
    assert 0 < tiered["budget_bytes"] < tiered["state_bytes"] + tiered["cotangent_bytes"]
    # The store never holds less than two chunk units, more than this tiny budget; what counts
    # is that state and cotangent were not resident whole.
    assert tiered["peak_resident_bytes"] < tiered["state_bytes"] + tiered["cotangent_bytes"]
    assert tiered["bytes_read"] > 0 and tiered["bytes_written"] > 0, tiered
    assert tiered["grad_max_abs_diff"] == 0.0, tiered
    assert tiered["pinned_host"] is False  # no CUDA here


def test_a_failing_section_keeps_its_rows_and_the_next_one_runs(selfcheck, tmp_path, monkeypatch):
    def broken(ctx, budget, record):
        record.setdefault("rows", []).append({"status": "ok", "done": 1})
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setitem(selfcheck.SECTION_FUNCTIONS, "kernels", broken)
    report = selfcheck.run(
        selfcheck.SMOKE.model_copy(update={"budgets_s": dict.fromkeys(selfcheck.SECTIONS, 0.0)}),
        torch.device("cpu"),
        tmp_path,
        ["kernels", "parity"],
        "smoke",
    )
    kernels, parity = report["sections"]["kernels"], report["sections"]["parity"]
    assert kernels["status"] == "failed"
    assert kernels["reason"] == "error: RuntimeError: kernel exploded"
    assert kernels["rows"] == [{"status": "ok", "done": 1}]
    # A spent budget skips every configuration of the section instead of running it.
    assert parity["status"] == "partial"
    assert all(r["status"].startswith("skipped: section budget") for r in parity["rows"])
    assert json.loads((tmp_path / "gpu_selfcheck.json").read_text())["sections"].keys() == {
        "kernels",
        "parity",
    }


def test_the_hard_limit_stops_a_section_that_overruns(selfcheck):
    started = time.perf_counter()
    with pytest.raises(selfcheck.SectionTimeout), selfcheck._hard_limit(0.05):
        while time.perf_counter() - started < 5:
            time.sleep(0.01)
    assert time.perf_counter() - started < 1
    # The timer is off again afterwards.
    time.sleep(0.1)


def test_full_mode_without_cuda_skips_the_device_sections(selfcheck, tmp_path):
    sections = ["parity", "exact_gradient", "scale", "tiers"]
    report = selfcheck.run(selfcheck.FULL, torch.device("cpu"), tmp_path, sections, "full")
    assert {s["status"] for s in report["sections"].values()} == {selfcheck.NO_CUDA}


def test_a_section_fails_on_an_error_or_mismatch_row_and_is_partial_on_skips(selfcheck):
    ok, skipped = {"status": "ok"}, {"status": "skipped: predicted 9 s > 1 s left"}
    assert selfcheck._rows_status([ok, ok]) == "ok"
    assert selfcheck._rows_status([ok, skipped]) == "partial"
    assert selfcheck._rows_status([ok, skipped, {"status": "mismatch"}]) == "failed"
    assert selfcheck._rows_status([{"status": "error: RuntimeError: x"}]) == "failed"


def test_budget_skips_a_run_predicted_to_overrun(selfcheck):
    budget = selfcheck.Budget(100.0)
    assert budget.skip_reason() is None and budget.skip_reason(predicted_s=10.0) is None
    assert budget.skip_reason(predicted_s=1000.0).startswith("skipped: predicted 1000 s")
    rows = [{"status": "ok", "prompt_len": 1000, "step_s": 2.0, "prompt_grad": "exact"}]
    assert selfcheck._predicted(rows, 4000, "step_s", prompt_grad="exact") == 32.0
    assert selfcheck._predicted(rows, 4000, "step_s", prompt_grad="detached") is None


@pytest.mark.processes
def test_smoke_runs_with_only_what_the_gpu_image_has_or_the_wheels_carry(smoke, blocked):
    """The GPU machine's image lacks prefect, zarr, s3fs and pydantic and reaches no registry:
    the smoke run (every section ok, the tests above) had every other package blocked."""
    lacking = {m for m in ("prefect", "zarr", "s3fs", "moto") if importlib.util.find_spec(m)}
    assert lacking <= set(blocked), blocked  # those installed here
    assert not {"torch", "transformers", "pydantic", "pydantic_core", "yaml", "numpy"} & set(
        blocked
    )
    imported = set(smoke[3])
    assert {"torch", "transformers", "pydantic", "longstraw"} <= imported
    assert not imported & set(blocked)
    assert all(s["status"] == "ok" for s in smoke[0]["sections"].values())
