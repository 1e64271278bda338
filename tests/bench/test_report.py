"""The markdown tables of the rollout suites from minimal result files."""

from __future__ import annotations

import json

from bench.grpo.report import render

_MACHINE = {
    "command": "/somewhere/bench/grpo/__main__.py decode --repeats 3",
    "date": "d",
    "cpus": 2,
    "memory_gib": 1.0,
    "torch": "t",
    "load_average_at_start": [1.0, 1.0, 1.0],
}


def test_decode_and_rollout_results_render_as_tables(tmp_path):
    decode = {
        "suite": "decode",
        "machine": _MACHINE,
        "runs": [
            {
                "spec": {"prompt_tokens": 2048},
                "status": "ok",
                "load_average": [1.0, 2.0],
                "result": {"decode_step_s": {"1": 0.03, "8": 0.05}},
            }
        ],
        "summary": {
            "reference_tokens": 2048,
            "ratio_to_reference_same_process": {"8192": {"8": 1.5}},
        },
    }
    rollout = {
        "suite": "rollout",
        "machine": _MACHINE,
        "runs": [],
        "summary": {
            "points": {
                "8192": {
                    "trl-generate": {"step_s": [100.0]},
                    "rollout": {"step_s": [10.0]},
                    "ratio_trl_over_longstraw": 10.0,
                }
            }
        },
    }
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    (tmp_path / "rollout.json").write_text(json.dumps(rollout))
    text = render(tmp_path)
    assert "`longstraw bench decode --repeats 3`" in text
    assert "| 2048 | 1.0–2.0 | 30.0 ms | 50.0 ms |" in text
    assert "| 8192 | – | 1.5× |" in text
    assert "| 8192 | 100.0 | 10.0 | 10.0× |" in text
