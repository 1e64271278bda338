"""2 ranks (gloo, CPU) vs the single-process engine at the same prompt: memory and communication.

Each configuration runs in its own spawned processes (clean per-process peak RSS). Reports, per
rank: prompt-state bytes (K/V), its fp32 cotangent (exact mode), peak RSS, stage times, and the
bytes each rank sent into the cross-rank attention's collectives during prefill, one branch's
replay (forward + backward) and the sweep. Usage:

    .venv/bin/python bench/bench_distributed.py --family qwen3_5 --size small --prompt-len 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning (spawned ranks inherit it): on this 2-core machine
# spinning threads made the 2-thread single process 3x slower than 2 one-thread ranks.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from longstraw.distributed.launch import run_on_ranks
from longstraw.schemas.run import EngineConfig

SEED = 42


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _inputs(vocab: int, prompt_len: int, num_branches: int, branch_len: int):
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    responses = [torch.randint(0, vocab, (branch_len,), generator=gen) for _ in range(num_branches)]
    advantages = torch.randn(num_branches, generator=gen)
    return prompt, responses, advantages


def single_process(
    rank, world, checkpoint, prompt_len, shard_tokens, num_branches, branch_len, threads
):
    from longstraw.engine.group import GradBuffer, accumulate_group_gradients
    from longstraw.engine.prefill import prefill
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    torch.set_num_threads(threads)
    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    prompt, responses, advantages = _inputs(
        model.config.get_text_config().vocab_size, prompt_len, num_branches, branch_len
    )
    base = _rss()
    started = time.perf_counter()
    state = prefill(model, prompt, shard_tokens=shard_tokens)
    prefill_s = time.perf_counter() - started
    stats = accumulate_group_gradients(
        model, state, responses, advantages, GRPOConfig(beta=0.0),
        EngineConfig(shard_tokens=shard_tokens, prompt_grad="exact"),
        grad_buffer=GradBuffer(model),
    )  # fmt: skip
    return {
        "threads": torch.get_num_threads(),
        "state_bytes": state.state_bytes(),
        "checkpoint_bytes": state.checkpoint_bytes(),
        "cotangent_bytes": stats.cotangent_bytes,
        "rss_before_prefill": base,
        "peak_rss": _rss(),
        "prefill_s": prefill_s,
        "replay_s": stats.seconds.replay,
        "sweep_s": stats.seconds.sweep,
    }


def sharded(rank, world, checkpoint, prompt_len, shard_tokens, num_branches, branch_len):
    from longstraw.distributed import cross_rank_attention as cra
    from longstraw.distributed.exchange import CrossRankExchange
    from longstraw.engine.group import group_gradient, group_inputs
    from longstraw.engine.prefill import prefill
    from longstraw.engine.replay import PromptCotangent, replay_branch
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig

    model, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    prompt, responses, advantages = _inputs(
        model.config.get_text_config().vocab_size, prompt_len, num_branches, branch_len
    )
    base = _rss()
    out = {}
    started = time.perf_counter()
    exchange = CrossRankExchange()
    state = prefill(model, prompt, shard_tokens=shard_tokens, exchange=exchange)
    out["prefill_s"] = time.perf_counter() - started
    out["prefill_bytes_sent"] = cra.COMM.bytes_sent

    # One branch alone: forward + backward with a cotangent, to count its traffic.
    cra.COMM.__init__()
    cotangent = PromptCotangent.zeros_like_state(state)
    logp, _ = replay_branch(model, state, responses[0], cotangent=cotangent, exchange=exchange)
    logp.sum().backward()
    out["branch_bytes_sent"] = cra.COMM.bytes_sent
    out["branch_exchanges"] = cra.COMM.exchanges
    model.zero_grad(set_to_none=True)
    del cotangent, logp

    params = [p for p in model.parameters() if p.requires_grad]
    # Two dense fp32 accumulators (branch, sweep), what a rank would hold without slices.
    out["dense_accumulator_bytes"] = 2 * 4 * sum(p.numel() for p in params)

    cra.COMM.__init__()
    started = time.perf_counter()
    config = GRPOConfig(beta=0.0)
    inputs = group_inputs(model, responses, advantages, config, prompt_grad="exact")
    slices, _ = group_gradient(
        model, state, inputs, config, EngineConfig(prompt_grad="exact"), exchange=exchange
    )
    out["group_slices_s"] = time.perf_counter() - started
    out["slices_accumulator_bytes"] = slices.nbytes()
    out["slices_scatter_bytes_sent"] = slices.bytes_sent
    out["group_slices_attention_bytes_sent"] = cra.COMM.bytes_sent
    out.update(
        state_bytes=state.state_bytes(),
        checkpoint_bytes=state.checkpoint_bytes(),
        cotangent_bytes=sum(t.numel() * 4 for t in (state.keys, state.values) if t is not None),
        rss_before_prefill=base,
        peak_rss=_rss(),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="qwen3_5")
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--shard-tokens", type=int, default=1024)
    parser.add_argument("--branches", type=int, default=2)
    parser.add_argument("--branch-len", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from longstraw.models.factory import init_model

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(init_model(args.family, args.size, Path(tmp) / "ckpt", seed=SEED))
        common = (checkpoint, args.prompt_len, args.shard_tokens, args.branches, args.branch_len)
        singles = {
            threads: run_on_ranks(
                single_process, 1, *common, threads, timeout_s=1800, num_threads=threads
            )[0]
            for threads in (1, 2)
        }
        ranks = run_on_ranks(sharded, args.ranks, *common, timeout_s=1800, num_threads=1)
    result = {
        "config": vars(args) | {"out": None},
        "load_average_at_end": os.getloadavg(),
        "single": singles,
        "ranks": ranks,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
