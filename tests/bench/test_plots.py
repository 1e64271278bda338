"""Merging context runs for the plots: the first run that ran wins, the first file's cap stays."""

from __future__ import annotations

import json

from bench.grpo.plots import merge_context_runs


def _run(method: str, tokens: int, status: str, peak: int) -> dict:
    return {"spec": {"method": method, "prompt_tokens": tokens}, "status": status, "peak": peak}


def test_merge_keeps_the_first_ok_record_per_method_and_length(tmp_path):
    first = {
        "summary": {"mem_cap_bytes": 2, "group_size": 8},
        "runs": [_run("a", 8, "oom", 1), _run("a", 16, "ok", 2), _run("b", 8, "ok", 3)],
    }
    second = {
        "summary": {"mem_cap_bytes": 16, "group_size": 8},
        "runs": [_run("a", 8, "ok", 4), _run("a", 16, "ok", 5), _run("c", 4, "timeout", 6)],
    }
    paths = []
    for i, data in enumerate((first, second)):
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(data))
        paths.append(path)
    merged = merge_context_runs(paths)
    assert merged["summary"]["mem_cap_bytes"] == 2
    peaks = {(r["spec"]["method"], r["spec"]["prompt_tokens"]): r["peak"] for r in merged["runs"]}
    assert peaks == {("a", 8): 4, ("a", 16): 2, ("b", 8): 3, ("c", 4): 6}
