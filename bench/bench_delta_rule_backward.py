"""What the float64 backward of the gated delta rule costs, against an fp32 backward in the same run.

    .venv/bin/python bench/bench_delta_rule_backward.py [--tokens 2048] [--heads 4] [--dim 64]

Times (best of `--repeats`, after one warm-up) the forward and the backward of
- `blockwise`: `gated_delta_rule_recomputed_in_blocks` over transformers' forward, given the
  decay gate's inputs as the sweep and branch replay give it (its backward recomputes 256-token
  blocks in float64 and differentiates the gate's formation in float64);
- `blockwise, given g`: the same given the fp32 log-decays, autograd forming their gradients;
- `chunked`: LongStraw's chunked kernel given the decay gate (its backward recomputes in float64);
- `transformers fp32` (the baseline): autograd through transformers' own chunked kernel, an fp32
  backward of the same chunked form.
Every forward includes forming the log-decays g = -exp(A_log) * softplus(a + dt_bias), as the
layers do. Prints each backward as a ratio to the baseline's and writes JSON (`--out`).

Legend: B = 1, T tokens, H heads of D (keys and values), A = exp(A_log) in [0.001, 0.1], 2
threads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from longstraw.ops.blockwise_backward import gated_delta_rule_recomputed_in_blocks
from longstraw.ops.decay_gate import DecayGate
from longstraw.ops.gated_delta_rule import chunked_gated_delta_rule

KWARGS = {"initial_state": None, "output_final_state": True, "use_qk_l2norm_in_kernel": True}


def _kernels():
    forward = modeling_qwen3_5.torch_chunk_gated_delta_rule

    def blockwise(q, k, v, gate, beta):
        return gated_delta_rule_recomputed_in_blocks(
            forward, q, k, v, gate, beta, block_tokens=256, **KWARGS
        )

    def blockwise_given_g(q, k, v, gate, beta):
        return gated_delta_rule_recomputed_in_blocks(
            forward, q, k, v, gate.fp32(), beta, block_tokens=256, **KWARGS
        )

    def chunked(q, k, v, gate, beta):
        return chunked_gated_delta_rule(q, k, v, gate, beta, chunk_size=64, **KWARGS)

    def transformers_fp32(q, k, v, gate, beta):
        return forward(q, k, v, gate.fp32(), beta, **KWARGS)

    return {
        "blockwise": blockwise,
        "blockwise, given g": blockwise_given_g,
        "chunked": chunked,
        "transformers fp32": transformers_fp32,
    }


def _time(kernel, tokens: int, heads: int, dim: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    shape = (1, tokens, heads)
    q, k, v = (torch.randn(*shape, dim, generator=gen).requires_grad_(True) for _ in range(3))
    a = torch.randn(*shape, generator=gen).requires_grad_(True)
    A_log = torch.linspace(-6.9, -2.3, heads).requires_grad_(True)
    dt_bias = torch.ones(heads).requires_grad_(True)
    beta = torch.rand(*shape, generator=gen).requires_grad_(True)
    start = time.perf_counter()
    out, state = kernel(q, k, v, DecayGate(a, A_log, dt_bias), beta)
    middle = time.perf_counter()
    (out.sum() + state.sum()).backward()
    return middle - start, time.perf_counter() - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/delta_rule_backward.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = {}
    for name, kernel in _kernels().items():
        _time(kernel, args.tokens, args.heads, args.dim)  # warm-up
        runs = [_time(kernel, args.tokens, args.heads, args.dim) for _ in range(args.repeats)]
        rows[name] = {"forward_s": min(r[0] for r in runs), "backward_s": min(r[1] for r in runs)}
    baseline = rows["transformers fp32"]["backward_s"]
    print(f"T={args.tokens}, H={args.heads}, D={args.dim}, best of {args.repeats}")
    for name, row in rows.items():
        row["backward_vs_fp32_backward"] = row["backward_s"] / baseline
        print(
            f"{name:>18}: forward {row['forward_s']:.3f} s, backward {row['backward_s']:.3f} s "
            f"= {row['backward_vs_fp32_backward']:.2f} x the fp32 backward"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {"tokens": args.tokens, "heads": args.heads, "dim": args.dim}
    args.out.write_text(json.dumps({"config": config, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
