"""Per-parameter gradient error against a float64 truth, for every family and both modes.

    .venv/bin/python bench/bench_precision.py [--setting issue|tests] [--families ...]

The truth is the same weights with every operation in float64 (`tests/float64.py`), through
full-sequence autograd (exact mode) or transformers' cached path (detached mode); the tests'
helpers compute it (`tests/engine/float64_reference.py`). For each family, mode and weight dtype
it prints the relative error ||g - g64|| / ||g64|| of LongStraw's gradient (fp32 accumulation):
the worst parameter, the worst of the others than A_log / dt_bias ("other") and the worst of those
("decay"); the decay parameters' worst for transformers' own autograd (its chunked delta rule, and
its per-token recurrence); and the worst LongStraw / bar ratio, bar = max(1e-4, 10 x transformers' better fp32 error) — the
criterion of tests/engine/test_float64_gradient.py. bf16 rows are reported, not judged
(transformers' bf16 autograd accumulates in bf16).

Settings: `issue` — P = 700, shards of 256, the checkpoints' own A_log (A uniform in
[0.01, 16]); `tests` — the test's group (P = 301, shards of 96, sweep blocks of 40, A_log
spread from weak to strong decay).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "engine")]

from engine_helpers import random_group  # noqa: E402
from float64 import relative_errors  # noqa: E402
from float64_reference import REL_FLOOR, TIMES_TRANSFORMERS, float64_comparison  # noqa: E402

import longstraw  # noqa: E402
from longstraw.engine import sweep  # noqa: E402
from longstraw.models.checkpoint import load_checkpoint  # noqa: E402
from longstraw.models.factory import init_model  # noqa: E402
from longstraw.schemas.grpo import GRPOConfig  # noqa: E402

FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_next", "glm_moe_dsa")
SETTINGS = {
    "issue": dict(prompt_len=700, shard_tokens=256, block_tokens=256, a_log_ranges=None),
    "tests": dict(
        prompt_len=301, shard_tokens=96, block_tokens=40, a_log_ranges=((-7.0, 3.0), (1.0, 2.0))
    ),
}
RESPONSE_LENS = (9, 4, 13)
DECAY = ("A_log", "dt_bias")


def _model(family: str, root: str, a_log_ranges) -> torch.nn.Module:
    model, _, _ = load_checkpoint(init_model(family, "tiny", Path(root) / family, seed=42))
    model.eval()
    layers = [m for m in model.modules() if hasattr(m, "A_log")]
    if a_log_ranges is not None and layers:
        with torch.no_grad():
            for layer, (low, high) in zip(layers, a_log_ranges, strict=True):
                layer.A_log.copy_(torch.linspace(low, high, layer.A_log.numel()))
    return model


def _worst(errors: dict[str, float], names) -> tuple[float, str]:
    name = max(names, key=lambda n: errors[n])
    return errors[name], name.removeprefix("model.")


def run(setting: str, families) -> None:
    spec = SETTINGS[setting]
    sweep.SWEEP_BLOCK_TOKENS = spec["block_tokens"]
    cfg = GRPOConfig(loss_type="grpo")
    print(f"longstraw from {Path(longstraw.__file__).parent}; setting {setting}: {spec}")
    header = (
        "family", "mode", "dtype", "LS worst (parameter)", "LS other", "LS decay",
        "TF chunked decay", "TF recurrent decay", "worst LS / bar",
    )  # fmt: skip
    print(" | ".join(header))
    with tempfile.TemporaryDirectory() as root:
        for family in families:
            model32 = _model(family, root, spec["a_log_ranges"])
            for dtype in (torch.float32, torch.bfloat16):
                model = model32 if dtype == torch.float32 else copy.deepcopy(model32).to(dtype)
                prompt, responses, advantages = random_group(
                    spec["prompt_len"], RESPONSE_LENS, model.config.vocab_size
                )
                for mode in ("exact", "detached"):
                    started = time.perf_counter()
                    ours, theirs, truth = float64_comparison(
                        model,
                        prompt,
                        responses,
                        advantages,
                        cfg,
                        prompt_grad=mode,
                        shard_tokens=spec["shard_tokens"],
                    )
                    e_ours = relative_errors(ours, truth)
                    e_theirs = [relative_errors(g, truth) for g in theirs]
                    decay = [n for n in truth if n.endswith(DECAY)]
                    best = {n: min(e[n] for e in e_theirs) for n in truth}
                    ratio = max(
                        e_ours[n] / max(REL_FLOOR, TIMES_TRANSFORMERS * best[n]) for n in truth
                    )
                    worst, name = _worst(e_ours, truth)
                    other = [n for n in truth if n not in decay]
                    cells = [
                        family,
                        mode,
                        str(dtype).removeprefix("torch."),
                        f"{worst:.1e} ({name})",
                        f"{_worst(e_ours, other)[0]:.1e}",
                        f"{_worst(e_ours, decay)[0]:.1e}" if decay else "-",
                        *(f"{_worst(e, decay)[0]:.1e}" if decay else "-" for e in e_theirs),
                        *([] if decay else ["-"]),
                        f"{ratio:.2g}",
                    ]
                    print(" | ".join(cells), f"({time.perf_counter() - started:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="issue")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run(args.setting, args.families)


if __name__ == "__main__":
    main()
