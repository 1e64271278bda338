"""Prefill wall time: sequential (`engine.prefill` over `CrossRankExchange`) vs layer wavefront
(`wavefront_prefill`) on N ranks of 1 thread each, against the single-process prefill (1 thread,
and 2) on the same prompt.

Every configuration runs in its own spawned processes, after a short warm-up prefill; each
sharded schedule is timed `--repeats` times, interleaved (sequential, wavefront, sequential, ...),
and the minimum is kept. A prefill's time is the slowest rank's (all ranks start together after
a barrier). The machine's load average before and after is recorded: on a shared machine a
single noisy run is not a measurement. Usage:

    .venv/bin/python bench/bench_wavefront.py --prompt-len 2048 --shard-tokens 256 \\
        --out bench/results/wavefront.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning (spawned ranks inherit it): on a shared 2-core
# machine two spinning threads made a 2-thread prefill 10x slower than a 1-thread one.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from longstraw.distributed.launch import run_on_ranks

SEED = 42
# Warm-up prefill (first-call costs out of the timed runs): 4 shards of 32 tokens.
WARMUP_SHARD, WARMUP_SHARDS = 32, 4


def _prompt(model, prompt_len: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (prompt_len,), generator=gen)


def single_process(rank, world, checkpoint, prompt_len, shard_tokens, threads, repeats):
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint

    torch.set_num_threads(threads)
    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    prompt = _prompt(model, prompt_len)
    prefill(model, prompt[: WARMUP_SHARD * WARMUP_SHARDS + 1], shard_tokens=WARMUP_SHARD)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        prefill(model, prompt, shard_tokens=shard_tokens)
        times.append(time.perf_counter() - started)
    return {"threads": torch.get_num_threads(), "prefill_s": times}


def sharded(rank, world, checkpoint, prompt_len, shard_tokens, repeats, attention_window):
    import torch.distributed as dist

    from longstraw.distributed import cross_rank_attention as cra
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.wavefront_prefill import wavefront_prefill
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    prompt = _prompt(model, prompt_len)

    def sequential(*args, **kwargs):
        return prefill(*args, exchange=CrossRankExchange(), **kwargs)

    def wavefront(*args, **kwargs):
        return wavefront_prefill(*args, attention_window=attention_window, **kwargs)

    schedules = {"sequential": sequential, "wavefront": wavefront}
    for run in schedules.values():
        run(model, prompt[: WARMUP_SHARD * WARMUP_SHARDS + 1], shard_tokens=WARMUP_SHARD)
    out: dict = {"threads": torch.get_num_threads()}
    states = {}
    for _ in range(repeats):
        for name, run in schedules.items():
            dist.barrier()
            before = cra.COMM.bytes_sent
            started, cpu = time.perf_counter(), time.process_time()
            states[name] = run(model, prompt, shard_tokens=shard_tokens)
            out.setdefault(f"{name}_s", []).append(time.perf_counter() - started)
            # CPU seconds of this rank's process (all its threads, gloo's included).
            out.setdefault(f"{name}_cpu_s", []).append(time.process_time() - cpu)
            out[f"{name}_bytes_sent"] = cra.COMM.bytes_sent - before
    sequential, wavefront = states["sequential"], states["wavefront"]
    fields = [n for n in STATE_FIELDS if getattr(sequential, n) is not None]
    assert fields, "no state field to compare"
    out["bitwise"] = all(torch.equal(getattr(wavefront, n), getattr(sequential, n)) for n in fields)
    out["fields_compared"] = fields
    out["shards"] = list(sequential.shards)
    out["layers"] = sequential.spec.num_layers
    out["state_bytes"] = sequential.state_bytes()
    return out


STATE_FIELDS = (
    "keys", "values", "latent", "rope_key", "indexer_key",
    "conv", "recurrent", "final_conv", "final_recurrent",
)  # fmt: skip


def peak_rss(rank, world, checkpoint, prompt_len, shard_tokens, schedule, attention_window):
    """One prefill of `schedule` in fresh processes: this rank's peak RSS before and after it."""
    import resource

    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.distributed.wavefront_prefill import wavefront_prefill
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    model.eval()
    prompt = _prompt(model, prompt_len)
    if schedule == "wavefront":
        run, kwargs = wavefront_prefill, {"attention_window": attention_window}
    else:
        run, kwargs = prefill, {"exchange": CrossRankExchange()}
    run(model, prompt[: WARMUP_SHARD * WARMUP_SHARDS + 1], shard_tokens=WARMUP_SHARD, **kwargs)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = run(model, prompt, shard_tokens=shard_tokens, **kwargs)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss_before": before, "peak_rss": after, "state_bytes": state.state_bytes()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3_5")
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--shard-tokens", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--attention-window", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from longstraw.models.factory import init_model

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(init_model(args.family, args.size, Path(tmp) / "ckpt", seed=SEED))
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        layers = config.get("text_config", config)["num_hidden_layers"]
        common = (checkpoint, args.prompt_len, args.shard_tokens)
        singles = {
            threads: run_on_ranks(
                single_process, 1, *common, threads, args.repeats,
                timeout_s=3600, num_threads=threads,
            )[0]
            for threads in (1, 2)
        }  # fmt: skip
        ranks = run_on_ranks(
            sharded,
            args.ranks,
            *common,
            args.repeats,
            args.attention_window,
            timeout_s=3600,
            num_threads=1,
        )
        # Peak memory per rank, each schedule in its own processes (ru_maxrss never falls).
        memory = {
            schedule: run_on_ranks(
                peak_rss, args.ranks, *common, schedule, args.attention_window,
                timeout_s=3600, num_threads=1,
            )
            for schedule in ("sequential", "wavefront")
        }  # fmt: skip
    load_after = os.getloadavg()

    single_1 = min(singles[1]["prefill_s"])
    single_2 = min(singles[2]["prefill_s"])
    # A sharded prefill ends when its slowest rank does; min over repeats of that.
    sequential = min(max(run) for run in zip(*(r["sequential_s"] for r in ranks), strict=True))
    wavefront = min(max(run) for run in zip(*(r["wavefront_s"] for r in ranks), strict=True))
    summary = {
        "single_1thread_s": single_1,
        "single_2threads_s": single_2,
        "sequential_s": sequential,
        "wavefront_s": wavefront,
        "sequential_over_single_1thread": sequential / single_1,
        "wavefront_over_single_1thread": wavefront / single_1,
        "wavefront_over_sequential": wavefront / sequential,
        # Equal-cost layers: the wavefront's L + N - 1 steps of 1/N of the shards, vs L·N.
        "ideal_wavefront_over_sequential": (layers + args.ranks - 1) / (layers * args.ranks),
        "bitwise": all(r["bitwise"] for r in ranks),
        # Peak RSS growth during the prefill, per rank (MB), and the rank's state (MB).
        "prefill_peak_rss_growth_MB": {
            schedule: [(r["peak_rss"] - r["peak_rss_before"]) / 1e6 for r in rs]
            for schedule, rs in memory.items()
        },
        "state_MB_per_rank": [r["state_bytes"] / 1e6 for r in memory["sequential"]],
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "cpus": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    result = {
        "config": vars(args) | {"out": None},
        "summary": summary,
        "single": singles,
        "ranks": ranks,
        "memory": memory,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
