"""Run one benchmark configuration in this (fresh) process and write its result as JSON.

    python -m bench.grpo.worker SPEC_JSON OUT_JSON

The model is loaded and the method warmed up on a 256-token prompt (first-call costs are not the
method's), then the configuration runs once. Peak RSS is this process's high-water mark
(`ru_maxrss`, = VmHWM), so each configuration must have a process of its own.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.grpo import methods
from bench.grpo.workload import BenchSpec, build_batch

_WARMUP_PROMPT_TOKENS = 256


def current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_method(model, spec: BenchSpec, work_dir: str) -> dict:
    batch = build_batch(spec, model.config.get_text_config().vocab_size)
    if spec.method in ("longstraw-exact", "longstraw-detached"):
        return methods.longstraw_step(model, spec, batch, spec.method.split("-")[1])
    if spec.method == "full-sequence":
        return methods.full_sequence_step(model, spec, batch)
    if spec.method == "trl":
        return methods.trl_step(model, spec, batch, work_dir)
    if spec.method == "prefill":
        return methods.prefill_step(model, spec, batch)
    if spec.method == "rollout":
        return methods.rollout_step(model, spec, batch)
    if spec.method == "trl-generate":
        return methods.trl_generate_step(model, spec, batch, work_dir)
    if spec.method == "decode-steps":
        return methods.decode_steps(model, spec, batch)
    if spec.method == "hf-forward":
        return methods.hf_forward_step(model, spec, batch)
    assert spec.method == "fidelity", spec.method
    return methods.fidelity_step(model, spec, batch, work_dir)


def main(argv: list[str]) -> int:
    spec = BenchSpec.model_validate_json(argv[1])
    out = Path(argv[2])
    torch.set_num_threads(int(os.environ.get("LONGSTRAW_BENCH_THREADS", "2")))
    torch.manual_seed(spec.seed)
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        spec.checkpoint, dtype=torch.float32, attn_implementation="sdpa"
    )
    with tempfile.TemporaryDirectory() as work_dir:
        if spec.method != "fidelity":
            warmup = spec.model_copy(
                update={
                    "prompt_tokens": min(_WARMUP_PROMPT_TOKENS, spec.prompt_tokens),
                    # TRL's GRPO refuses fewer than 2 generations per prompt.
                    "group_size": 2 if spec.method == "trl-generate" else 1,
                    "shard_tokens": min(spec.shard_tokens, 128),
                    "decode_group_sizes": (),
                    "decode_repeats": 1,
                    "decode_reference_tokens": 0,
                }
            )
            run_method(model, warmup, work_dir)
            model.zero_grad(set_to_none=True)
        baseline = current_rss_bytes()
        result = run_method(model, spec, work_dir)
    result.update(
        status="ok",
        spec=spec.model_dump(),
        baseline_rss_bytes=baseline,
        peak_rss_bytes=peak_rss_bytes(),
        kv_fp32_bytes=methods.kv_fp32_bytes(model, spec.prompt_tokens),
        process_s=time.perf_counter() - started,
        torch_threads=torch.get_num_threads(),
    )
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
