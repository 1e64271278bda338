"""One decoding step of two source trees of LongStraw on the same saved prefix states, alternated.

    python bench/bench_decode_ab.py --trees OLD_TREE,NEW_TREE --prompt-lengths 2048,8192 \
        --out bench/results/decode_before_after.json

A tree is a directory holding a `longstraw` package (a checkout, or `git worktree add /tmp/old
<commit>`). The state of each P is prefilled once (with the first tree) and saved as
safetensors under `--state-dir`; every run is a fresh process that imports `longstraw` from one
tree, loads that state, decodes 2 tokens as a warm-up, then G rows for `--tokens` steps (sampling
included, temperature 1, no filters). For each P the trees run in turn, the order reversed every
repeat. One torch thread, `OMP_WAIT_POLICY=PASSIVE`, as the suites (`LONGSTRAW_BENCH_THREADS`
sets another count). `--breakdown` adds, per run, the seconds per step spent in each kind of
module (forward hooks) and in the registered attention function, and the top ops of a profiled
4-step decode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, os, sys, time, torch
import longstraw
torch.set_num_threads(int(os.environ.get("LONGSTRAW_BENCH_THREADS", "1")))
from pathlib import Path
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from longstraw.engine.rollout import SamplingParams, sample_responses
from longstraw.engine.state import PrefixState
from longstraw.models.adapters import state_spec

mode, checkpoint, state_file, prompt_tokens, rows, tokens = sys.argv[1:7]
model = AutoModelForCausalLM.from_pretrained(
    checkpoint, dtype=torch.float32, attn_implementation="sdpa"
).eval()
if mode == "prefill":
    from longstraw.engine.prefill import prefill

    prompt = torch.randint(1, model.config.vocab_size, (int(prompt_tokens),),
                           generator=torch.Generator().manual_seed(42))
    started = time.perf_counter()
    state = prefill(model, prompt, shard_tokens=2048)
    seconds = time.perf_counter() - started
    arrays = {k.replace("/", "."): v.contiguous() for k, v in state.tensors().items()}
    save_file({**arrays, "prompt_ids": prompt}, state_file)
    print(json.dumps({"prefill_s": seconds}))
    sys.exit()
arrays = load_file(state_file)
prompt = arrays.pop("prompt_ids")
state = PrefixState.from_tensors(
    state_spec(model), prompt_ids=prompt, shard_tokens=2048,
    tensors={k.replace(".", "/"): v for k, v in arrays.items()},
)
rows, tokens = int(rows), int(tokens)
sample_responses(model, state, SamplingParams(num_samples=rows, max_new_tokens=2))
extra = {}
if mode == "breakdown":
    # Seconds per step in each kind of module (forward hooks) and in the registered attention
    # function, then the top ops of a 4-step torch.profiler run.
    from collections import defaultdict
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from longstraw.engine.attention import ATTENTION_NAME

    spent, starts = defaultdict(float), {}
    kinds = {"self_attn": "full-attention layer", "linear_attn": "Gated DeltaNet layer",
             "mlp": "MLP", "lm_head": "lm_head", "input_layernorm": "norms",
             "post_attention_layernorm": "norms", "norm": "norms"}
    for name, module in model.named_modules():
        kind = kinds.get(name.split(".")[-1])
        if kind is None:
            continue
        module.register_forward_pre_hook(lambda m, a, k=kind: starts.__setitem__(id(m), time.perf_counter()))
        module.register_forward_hook(lambda m, a, o, k=kind: spent.__setitem__(k, spent[k] + time.perf_counter() - starts[id(m)]))
    attention = ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]
    def timed_attention(*a, **k):
        t0 = time.perf_counter()
        out = attention(*a, **k)
        spent["attention function"] += time.perf_counter() - t0
        return out
    AttentionInterface.register(ATTENTION_NAME, timed_attention)
started = time.perf_counter()
out = sample_responses(model, state, SamplingParams(num_samples=rows, max_new_tokens=tokens),
                       generator=torch.Generator().manual_seed(1))
seconds = time.perf_counter() - started
if mode == "breakdown":
    extra["module_s_per_step"] = {k: v / tokens for k, v in spent.items()}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        sample_responses(model, state, SamplingParams(num_samples=rows, max_new_tokens=4))
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    extra["top_ops"] = [
        {"op": e.key, "shapes": str(e.input_shapes), "calls": e.count,
         "self_cpu_share": e.self_cpu_time_total / total}
        for e in sorted(prof.key_averages(group_by_input_shape=True),
                        key=lambda e: -e.self_cpu_time_total)[:8]
    ]
print(json.dumps({"decode_step_s": seconds / tokens, "token_ids": [r.token_ids for r in out],
                  "longstraw": longstraw.__file__, **extra}))
"""


def _child(tree: str, *args: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": tree,
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    # cwd = the tree: `python -c` puts the working directory first on sys.path.
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    imported = result.get("longstraw")
    if imported is not None and not Path(imported).resolve().is_relative_to(Path(tree).resolve()):
        raise RuntimeError(f"tree {tree} imported longstraw from {imported}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="OLD,NEW source trees")
    parser.add_argument("--prompt-lengths", default="2048,8192,32768,65536")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkpoint", default=".longstraw/bench/qwen3_5-small")
    parser.add_argument("--state-dir", default=".longstraw/bench/decode_states")
    parser.add_argument("--out", default="bench/results/decode_before_after.json")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each kind of module per step and keep the top ops of a profiled run",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.grpo.suites import machine
    from bench.grpo.workload import ensure_checkpoint

    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    checkpoint = str(ensure_checkpoint(Path(args.checkpoint).resolve().parent))
    state_dir = Path(args.state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    runs = []
    for p in (int(x) for x in args.prompt_lengths.split(",")):
        state_file = str(state_dir / f"state_{p}.safetensors")
        if not Path(state_file).exists():
            _child(trees[0], "prefill", checkpoint, state_file, str(p), "0", "0")
        for repeat in range(args.repeats):
            for tree in trees if repeat % 2 == 0 else trees[::-1]:
                before = os.getloadavg()[0]
                mode = "breakdown" if args.breakdown else "decode"
                result = _child(
                    tree, mode, checkpoint, state_file, str(p), str(args.rows), str(args.tokens)
                )
                record = {
                    "tree": tree,
                    "prompt_tokens": p,
                    "load_average": [before, os.getloadavg()[0]],
                    **result,
                }
                print(
                    f"P={p:>6} {tree}: {1e3 * record['decode_step_s']:.1f} ms/step "
                    f"(load {before:.1f})",
                    flush=True,
                )
                runs.append(record)
    summary = {}
    for p in sorted({r["prompt_tokens"] for r in runs}):
        per_tree = {
            t: [r["decode_step_s"] for r in runs if r["tree"] == t and r["prompt_tokens"] == p]
            for t in trees
        }
        same = len({json.dumps(r["token_ids"]) for r in runs if r["prompt_tokens"] == p}) == 1
        summary[p] = {
            "decode_step_s": per_tree,
            "ratio_old_over_new": min(per_tree[trees[0]]) / min(per_tree[trees[1]]),
            "same_token_ids": same,
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"suite": "decode_ab", "machine": info, "trees": trees, "rows": args.rows,
            "tokens": args.tokens, "runs": runs, "summary": summary}  # fmt: skip
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
