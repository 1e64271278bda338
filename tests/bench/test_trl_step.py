"""bench/bench_trl_step.py at a toy size: one TRL `train()` step and one `longstraw train` step,
each in its own process, on the same checkpoint, prompt ids and reward."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_trl_step.py"


def test_reward_is_one_function_of_the_text(bench_script, tmp_path):
    module = bench_script("bench_trl_step")
    namespace: dict = {}
    exec(module.REWARD_SOURCE, namespace)
    scores = [namespace["reward"]("", text) for text in ("abc", "abd", "", "zzzz")]
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert len(set(scores)) > 1, "a reward equal for every completion gives zero advantages"


def test_both_systems_take_one_step_on_the_same_workload(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "trl_step.json"
    result = subprocess.run(
        [sys.executable, str(_SCRIPT), "--size", "tiny", "--prompt-len", "63", "--group", "2",
         "--completion", "3", "--shard-tokens", "23", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    runs = {run["system"]: run for run in record["runs"]}
    assert set(runs) == {"trl", "longstraw"}
    for run in runs.values():
        assert run["step_s"] > 0 and run["generation_s"] > 0 and run["train_s"] > 0
        assert run["peak_rss_bytes"] > 0
        assert len(run["load_average_before"]) == 3
    assert runs["trl"]["completion_tokens"] == [3, 3]
    assert record["summary"]["step_s"]["trl_over_longstraw"] > 0
