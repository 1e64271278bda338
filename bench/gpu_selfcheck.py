"""One command that validates LongStraw on a GPU: kernels, parity, exact gradients, a 1M-token step.

    timeout 590 .venv/bin/python bench/gpu_selfcheck.py --out bench/results   # one H200: < 10 min
    .venv/bin/python bench/gpu_selfcheck.py --smoke --out /tmp/selfcheck      # a CPU: seconds

Writes `<out>/gpu_selfcheck.json` (after every section, so a killed run keeps what it finished)
and `<out>/gpu_selfcheck.md` (the same as tables). Sections, each under its own time budget (no
new configuration starts past it; the section is stopped at 1.2x it + 10 s) and its own
try/except (a failure or an exhausted budget is recorded with the rows done so far, and the next
section still runs):

- `kernels`: flash-attn, fla, causal-conv1d (installed, version, importable), the function
  transformers bound for each Gated DeltaNet kernel, and the kernel each call site ran
  (`longstraw.ops.dispatch`) in a short exact step on the device;
- `parity`: log-probs of prefill + branch replay against one transformers forward over
  prompt + response, per family, fp32 and bf16;
- `exact_gradient`: exact-mode gradient against float64 autograd of the full sequence, per
  parameter, judged by the tests' criterion (`tests/engine/float64_reference.py`);
- `scale`: the `small` Qwen3.5 hybrid at P = 128K, 512K, 1M, detached and exact, G = 2 and 8:
  prefill tokens/s, seconds per stage, `torch.cuda.max_memory_allocated`;
- `tiers`: an exact step with `engine.state_budget_bytes` below the state (host tier, pinned on
  CUDA) against the resident step: peak allocated, bytes moved, step time, gradient difference.

A configuration whose predicted time (the last comparable one scaled by (P / P_last)^2) passes
its section's remaining budget is recorded as skipped with the prediction. `--smoke` runs every
section with tiny prompts and tiny models on whatever device there is (the CPU in CI); what
needs CUDA (device memory figures, pinned memory) is then "skipped: no CUDA device".

Nothing changes the device's settings: no TF32, cuDNN, memory-fraction or clock knob is touched
(the JSON records the torch flags before and after). The process's own peak-memory counter is
reset before each measured step. Exact mode runs under deterministic algorithms, which cuBLAS
refuses without `CUBLAS_WORKSPACE_CONFIG`; the check sets `:4096:8` for its own process when it
is unset and records that it did.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

# The tests' references (float64 truth, transformers' own paths) and, for a checkout that is not
# installed, the package itself.
ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
for _path in (ROOT, TESTS, TESTS / "engine"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# cuBLAS reads it when its handle is created: set before torch touches CUDA.
_CUBLAS_SET_HERE = "CUBLAS_WORKSPACE_CONFIG" not in os.environ
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_next", "glm_moe_dsa")
SECTIONS = ("kernels", "parity", "exact_gradient", "scale", "tiers")
NO_CUDA = "skipped: no CUDA device"
_GIB = 2**30


class SelfCheckConfig(BaseModel):
    """What the self-check runs; `FULL` on one GPU, `SMOKE` on a CPU in seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    families: tuple[str, ...] = FAMILIES
    """Families of the parity section (tiny checkpoints)."""
    parity_prompt_len: int = Field(default=4097, ge=2)
    """P of the parity section: odd, over several prefix chunks of 1024 keys."""
    parity_shard_tokens: int = Field(default=1000, ge=1)
    """Shards that do not divide P - 1."""
    response_lens: tuple[int, ...] = (1, 6, 17)
    """Unequal responses; R = 1 takes Gated DeltaNet's 1-token path."""
    gradient_families: tuple[str, ...] = ("llama", "qwen3_5", "qwen3_next", "glm_moe_dsa")
    """Families of the exact-gradient section."""
    gradient_prompt_len: int = Field(default=301, ge=2)
    """Small P: the float64 truth runs the full sequence through autograd."""
    gradient_shard_tokens: int = Field(default=96, ge=1)
    scale_size: str = "small"
    """Checkpoint size of the scale and tiers sections (`small`: hidden 512, 8 layers)."""
    scale_lengths: tuple[int, ...] = (131_072, 524_288, 1_048_576)
    scale_groups: tuple[int, ...] = (2, 8)
    scale_shard_tokens: int = Field(default=16_384, ge=1)
    """Large shards: on a GPU the per-shard and per-chunk launches, not the FLOPs, cost at 2048."""
    scale_dtype: str = "bfloat16"
    tiers_prompt_len: int = Field(default=131_072, ge=2)
    tiers_group: int = Field(default=2, ge=1)
    tiers_budget_fraction: float = Field(default=0.25, gt=0, lt=1)
    """Budget = this fraction of the state (and its cotangent): below the state, as asked."""
    budgets_s: dict[str, float] = Field(
        default_factory=lambda: {
            "kernels": 45,
            "parity": 60,
            "exact_gradient": 60,
            "scale": 240,
            "tiers": 60,
        }
    )
    """Seconds per section (soft: no new configuration starts past it; hard: the section is
    stopped at 1.2x + 10 s). 465 s in all, so start-up and model builds fit in ten minutes."""
    require_cuda: bool = True
    """Every section but `kernels` is skipped without a CUDA device (the GPU check proper)."""


FULL = SelfCheckConfig()
SMOKE = SelfCheckConfig(
    families=("qwen3_5", "glm_moe_dsa"),
    parity_prompt_len=23,
    parity_shard_tokens=5,
    gradient_families=("llama",),
    gradient_prompt_len=23,
    gradient_shard_tokens=7,
    scale_size="tiny",
    scale_lengths=(33, 65),
    scale_groups=(1, 2),
    scale_shard_tokens=32,
    scale_dtype="float32",
    tiers_prompt_len=40,
    tiers_group=1,
    budgets_s=dict.fromkeys(SECTIONS, 60.0),
    require_cuda=False,
)
"""Every section's code path on tiny inputs (CI runs it on a CPU)."""


# --- running a section -------------------------------------------------------------------------


class Budget:
    """A section's clock: what is left, and whether a predicted run still fits."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def remaining(self) -> float:
        return self.seconds - self.elapsed()

    def skip_reason(self, predicted_s: float | None = None) -> str | None:
        """None when a run predicted to take `predicted_s` (None: unknown) may start."""
        if self.remaining() <= 0:
            return f"skipped: section budget of {self.seconds:.0f} s spent"
        if predicted_s is not None and predicted_s > self.remaining():
            return (
                f"skipped: predicted {predicted_s:.0f} s > {self.remaining():.0f} s left "
                "of the section budget"
            )
        return None


def _error(exc: BaseException) -> str:
    return f"error: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"


class Context:
    """What every section reads: the device, the config, checkpoints built once per run."""

    def __init__(self, config: SelfCheckConfig, device: torch.device, scratch: Path):
        self.config, self.device, self.scratch = config, device, scratch
        self._checkpoints: dict[tuple[str, str], Path] = {}
        self._models: dict[tuple[str, torch.dtype, str], torch.nn.Module] = {}

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def checkpoint(self, family: str, size: str = "tiny") -> Path:
        from longstraw.models.factory import init_model

        key = (family, size)
        if key not in self._checkpoints:
            self._checkpoints[key] = init_model(family, size, self.scratch / f"{family}-{size}")
        return self._checkpoints[key]

    def model(self, family: str, dtype: torch.dtype, size: str = "tiny"):
        """The run's model of `family` in `dtype` on the device (loaded once), no `.grad`."""
        from longstraw.models.checkpoint import load_checkpoint

        key = (family, dtype, size)
        if key not in self._models:
            model, _, _ = load_checkpoint(self.checkpoint(family, size), dtype=dtype)
            self._models[key] = model.to(self.device).eval()
        model = self._models[key]
        for param in model.parameters():
            param.grad = None
        return model

    def drop_models(self) -> None:
        self._models.clear()
        self.release()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def release(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


class SectionTimeout(BaseException):
    """A section ran past its hard limit (a BaseException: the per-row handlers must not
    swallow it)."""


@contextlib.contextmanager
def _hard_limit(seconds: float):
    """Raise SectionTimeout in this (main) thread after `seconds`; no limit elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SectionTimeout(f"stopped at the hard limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_section(name: str, fn: Callable[[Context, Budget, dict], None], ctx: Context) -> dict:
    """The record `fn` fills in place (rows survive a failure) with status, seconds, budget; an
    exception or the hard time limit becomes status "failed" with the reason."""
    budget = Budget(ctx.config.budgets_s[name])
    record: dict = {}
    try:
        if name != "kernels" and ctx.config.require_cuda and not ctx.cuda:
            record["status"] = NO_CUDA
        else:
            with _hard_limit(budget.seconds * 1.2 + 10):
                fn(ctx, budget, record)
        record.setdefault("status", "ok")
    except (Exception, SectionTimeout) as exc:
        record.update(status="failed", reason=_error(exc), traceback=traceback.format_exc())
    ctx.drop_models()
    record["seconds"] = round(budget.elapsed(), 3)
    record["budget_s"] = budget.seconds
    return record


def _rows_status(rows: list[dict]) -> str:
    """ok when every row ran and passed; partial when some were skipped; failed otherwise."""
    statuses = {row["status"] for row in rows}
    if statuses <= {"ok"}:
        return "ok"
    if any(s.startswith("error") or s == "mismatch" for s in statuses):
        return "failed"
    return "partial"


def _device(x: torch.Tensor | list[torch.Tensor], device: torch.device):
    return x.to(device) if isinstance(x, torch.Tensor) else [t.to(device) for t in x]


# --- kernels -----------------------------------------------------------------------------------


def _bound_implementation(fn) -> str:
    """Where a transformers kernel function really goes: its `implementation` closure cell
    (`use_kernel_func_from_hub_with_fallback`) names fla / causal-conv1d or the torch fallback."""
    target = fn
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False))
    if "implementation" in cells:
        target = cells["implementation"].cell_contents
    target = getattr(target, "__wrapped__", target) if target is fn else target
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"


def _probe_kernels_ran(ctx: Context) -> dict[str, str]:
    """{"<family> <dtype> <site>": kernel} from the dispatch's log of one short exact step
    (prefill, replay, sweep) and three decoding steps of each tiny model, fp32 and bf16."""
    from longstraw.engine.group import accumulate_group_gradients
    from longstraw.engine.prefill import prefill
    from longstraw.engine.rollout import SamplingParams, sample_responses
    from longstraw.grpo.grad_buffer import GradBuffer
    from longstraw.ops import dispatch
    from longstraw.schemas.grpo import GRPOConfig
    from longstraw.schemas.run import EngineConfig

    ran = {}
    for family in ("qwen3_5", "glm_moe_dsa"):
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{family} {str(dtype).removeprefix('torch.')}"
            dispatch.reset_log()
            try:
                model = ctx.model(family, dtype)
                prompt, responses, advantages = _group(model.config.vocab_size, 2, 65, ctx.device)
                accumulate_group_gradients(
                    model, prompt, responses, advantages, GRPOConfig(),
                    EngineConfig(shard_tokens=16, prompt_grad="exact"),
                    grad_buffer=GradBuffer(model),
                )  # fmt: skip
                # A few decoding steps of the rollout (its own prefix partial).
                sample_responses(
                    model, prefill(model, prompt, shard_tokens=16),
                    SamplingParams(num_samples=2, max_new_tokens=3),
                    generator=torch.Generator(device=ctx.device).manual_seed(42),
                )  # fmt: skip
            except Exception as exc:  # what ran before the error is still reported
                ran[f"{name} step"] = _error(exc)
            for site, kernel in dispatch.kernels_ran().items():
                ran[f"{name} {site}"] = kernel
            if family == "glm_moe_dsa":
                # Absorbed MLA and the DSA selection have no kernel choice: LongStraw's torch.
                ran[f"{name} mla_attention"] = "torch (no dispatch)"
    dispatch.reset_log()
    return ran


def kernels_section(ctx: Context, budget: Budget, record: dict) -> None:
    from longstraw.models.kernels import GPU_KERNELS

    packages = []
    for module, dist in GPU_KERNELS.items():
        row = {"package": dist, "module": module, "installed": False, "version": None}
        row["installed"] = importlib.util.find_spec(module) is not None
        if row["installed"]:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                row["version"] = importlib.metadata.version(dist)
            try:
                importlib.import_module(module)
                row["import"] = "ok"
            except Exception as exc:  # a broken install is what this section is for
                row["import"] = _error(exc)
        else:
            row["import"] = "not installed"
        packages.append(row)
    bindings = {}
    for family in ("qwen3_5", "qwen3_next"):
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update"):
            fn = getattr(modeling, name, None)
            bindings[f"{family}.{name}"] = "absent" if fn is None else _bound_implementation(fn)
    record.update(packages=packages, transformers_bindings=bindings)
    try:
        record["kernels_ran"] = _probe_kernels_ran(ctx)
    except Exception as exc:
        record["kernels_ran"] = {"probe": _error(exc)}
        record["status"] = "failed"


# --- parity ------------------------------------------------------------------------------------


def _logprob_diffs(model, prompt_len, shard_tokens, response_lens, device) -> list[float]:
    """max |log p(LongStraw) - log p(transformers)| per response of one random group."""
    from dsa_reference import transformers_stable_topk
    from engine_helpers import full_sequence_logprobs, random_group, vocab_of

    from longstraw.engine.prefill import prefill
    from longstraw.engine.replay import branch_logprobs

    prompt, responses, _ = random_group(prompt_len, response_lens, vocab_of(model))
    prompt, responses = _device(prompt, device), _device(responses, device)
    state = prefill(model, prompt, shard_tokens=shard_tokens)
    # GLM-5's DSA top-k: transformers' torch.topk breaks the many ties of a random model
    # differently at different lengths; the tests' reference sorts stably (tests/dsa_reference.py).
    glm = model.config.model_type == "glm_moe_dsa"
    selection = transformers_stable_topk() if glm else contextlib.nullcontext()
    with torch.no_grad():
        ours = [branch_logprobs(model, state, response).float() for response in responses]
        with selection:
            theirs = [full_sequence_logprobs(model, prompt, r).float() for r in responses]
    diffs = [float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True)]
    return diffs


# fp32: one ulp of a log-prob near -6 is 4.8e-7 (tests/engine/test_prefill_replay_parity.py);
# 1e-5 absolute leaves room for a GPU's reordered reductions. bf16: docs/design.md's 2e-2 on
# log-probs of magnitude ~7 (vocab 512) is 0.15 absolute.
PARITY_TOL = {"float32": 1e-5, "bfloat16": 0.15}


def parity_section(ctx: Context, budget: Budget, record: dict) -> None:
    cfg = ctx.config
    rows = record.setdefault("rows", [])
    for family in cfg.families:
        for dtype_name in ("float32", "bfloat16"):
            row = {"family": family, "dtype": dtype_name, "device": str(ctx.device)}
            row["prompt_len"] = cfg.parity_prompt_len
            reason = budget.skip_reason()
            if reason is not None:
                rows.append({**row, "status": reason})
                continue
            try:
                model = ctx.model(family, getattr(torch, dtype_name))
                diffs = _logprob_diffs(
                    model,
                    cfg.parity_prompt_len,
                    cfg.parity_shard_tokens,
                    cfg.response_lens,
                    ctx.device,
                )
                worst = max(diffs)
                row.update(max_abs_diff=worst, tolerance=PARITY_TOL[dtype_name])
                row["status"] = "ok" if worst <= PARITY_TOL[dtype_name] else "mismatch"
            except Exception as exc:
                row["status"] = _error(exc)
            rows.append(row)
            ctx.release()
    record["status"] = _rows_status(rows)


# --- exact gradient ----------------------------------------------------------------------------


def exact_gradient_section(ctx: Context, budget: Budget, record: dict) -> None:
    from engine_helpers import random_group, vocab_of
    from float64 import relative_errors
    from float64_reference import REL_FLOOR, TIMES_TRANSFORMERS, float64_comparison

    from longstraw.schemas.grpo import GRPOConfig

    cfg = ctx.config
    rows = record.setdefault("rows", [])
    for family in cfg.gradient_families:
        row = {"family": family, "device": str(ctx.device), "prompt_len": cfg.gradient_prompt_len}
        reason = budget.skip_reason()
        if reason is not None:
            rows.append({**row, "status": reason})
            continue
        try:
            model = ctx.model(family, torch.float32)
            prompt, responses, advantages = random_group(
                cfg.gradient_prompt_len, (9, 4, 13), vocab_of(model)
            )
            ours, transformers32, truth = float64_comparison(
                model,
                _device(prompt, ctx.device),
                _device(responses, ctx.device),
                advantages,
                GRPOConfig(loss_type="grpo"),
                prompt_grad="exact",
                shard_tokens=cfg.gradient_shard_tokens,
            )
            errors = relative_errors(ours, truth)
            per_kernel = [relative_errors(grads, truth) for grads in transformers32]
            ratios = {
                name: err / max(REL_FLOOR, TIMES_TRANSFORMERS * min(e[name] for e in per_kernel))
                for name, err in errors.items()
            }
            worst = max(ratios, key=ratios.get)
            row.update(
                worst_parameter=worst.removeprefix("model."),
                worst_rel_error=errors[worst],
                worst_over_bar=ratios[worst],
                max_rel_error=max(errors.values()),
                status="ok" if ratios[worst] <= 1.0 else "mismatch",
            )
        except Exception as exc:
            row["status"] = _error(exc)
        rows.append(row)
        ctx.release()
    record["status"] = _rows_status(rows)


# --- scale -------------------------------------------------------------------------------------

# Responses of 27-37 tokens, as the GRPO benchmarks' workload (docs/benchmarks.md).
_RESPONSE_TOKENS = (27, 37)


def _group(vocab: int, num: int, prompt_len: int, device: torch.device, seed: int = 42):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    lens = torch.randint(_RESPONSE_TOKENS[0], _RESPONSE_TOKENS[1] + 1, (num,), generator=gen)
    responses = [torch.randint(0, vocab, (int(n),), generator=gen) for n in lens]
    advantages = torch.linspace(-1.0, 1.0, num)
    return _device(prompt, device), _device(responses, device), advantages


def _step(ctx: Context, model, state, num: int, prompt_grad: str, engine_extra=None):
    """One group's gradient from a prefilled state: stage seconds, peak allocated, the grads."""
    from longstraw.engine.group import accumulate_group_gradients
    from longstraw.grpo.grad_buffer import GradBuffer
    from longstraw.schemas.grpo import GRPOConfig
    from longstraw.schemas.run import EngineConfig

    _, responses, advantages = _group(model.config.vocab_size, num, 2, ctx.device)
    buffer = GradBuffer(model)
    engine = EngineConfig(
        prompt_grad=prompt_grad, shard_tokens=ctx.config.scale_shard_tokens, **(engine_extra or {})
    )
    ctx.synchronize()
    ctx.reset_peak()
    started = time.perf_counter()
    stats = accumulate_group_gradients(
        model, state, responses, advantages, GRPOConfig(), engine, grad_buffer=buffer
    )
    ctx.synchronize()
    step_s = time.perf_counter() - started
    peak = ctx.peak_allocated()
    measured = {
        "replay_s": stats.seconds.replay,
        "sweep_s": stats.seconds.sweep,
        "step_s": step_s,
        "peak_allocated_bytes": peak if peak is not None else NO_CUDA,
        "loss": stats.loss,
        "cotangent_bytes": stats.cotangent_bytes,
    }
    if stats.state_traffic is not None:
        measured.update(stats.state_traffic.model_dump())
    return measured, buffer


def _predicted(done: list[dict], prompt_len: int, key: str, **match) -> float | None:
    """The last finished row matching `match`, its `key` seconds scaled by (P / P_row)^2."""
    for row in reversed(done):
        if row.get("status") == "ok" and all(row.get(k) == v for k, v in match.items()):
            return row[key] * (prompt_len / row["prompt_len"]) ** 2
    return None


def scale_section(ctx: Context, budget: Budget, record: dict) -> None:
    from longstraw.engine.prefill import prefill
    from longstraw.ops import dispatch

    cfg = ctx.config
    prefills, rows = record.setdefault("prefill", []), record.setdefault("rows", [])
    growth = record.setdefault("group_growth", [])
    dispatch.reset_log()
    for prompt_len in cfg.scale_lengths:
        base = {"prompt_len": prompt_len, "dtype": cfg.scale_dtype, "device": str(ctx.device)}
        reason = budget.skip_reason(_predicted(prefills, prompt_len, "prefill_s"))
        if reason is not None:
            prefills.append({**base, "status": reason})
            continue
        try:
            # Loaded once (cached), after the first length that fits: a spent budget builds none.
            model = ctx.model("qwen3_5", getattr(torch, cfg.scale_dtype), cfg.scale_size)
            prompt, _, _ = _group(model.config.vocab_size, 1, prompt_len, ctx.device)
            ctx.synchronize()
            ctx.reset_peak()
            started = time.perf_counter()
            state = prefill(model, prompt, shard_tokens=cfg.scale_shard_tokens)
            ctx.synchronize()
            seconds = time.perf_counter() - started
            peak = ctx.peak_allocated()
            prefills.append(
                {
                    **base,
                    "status": "ok",
                    "prefill_s": seconds,
                    "prefill_tokens_per_s": (prompt_len - 1) / seconds,
                    "state_bytes": state.state_bytes(),
                    "peak_allocated_bytes": peak if peak is not None else NO_CUDA,
                }
            )
        except Exception as exc:
            prefills.append({**base, "status": _error(exc)})
            ctx.release()
            continue
        for prompt_grad in ("detached", "exact"):
            for num in cfg.scale_groups:
                row = {**base, "prompt_grad": prompt_grad, "group": num}
                predicted = _predicted(rows, prompt_len, "step_s", prompt_grad=prompt_grad)
                reason = budget.skip_reason(predicted)
                if reason is not None:
                    rows.append({**row, "status": reason})
                    continue
                try:
                    measured, buffer = _step(ctx, model, state, num, prompt_grad)
                    del buffer
                    rows.append({**row, **measured, "status": "ok"})
                except Exception as exc:
                    rows.append({**row, "status": _error(exc)})
                ctx.release()
        del state
        ctx.release()
        growth[:] = _group_growth(rows)
        record["kernels_ran"] = dispatch.kernels_ran()
    record["status"] = _rows_status(prefills + rows)


def _group_growth(rows: list[dict]) -> list[dict]:
    """Peak allocated of the largest G minus the smallest, per (P, mode): memory flat in G."""
    growth = []
    for prompt_len in sorted({r["prompt_len"] for r in rows}):
        for prompt_grad in ("detached", "exact"):
            ok = [
                r
                for r in rows
                if r["prompt_len"] == prompt_len
                and r["prompt_grad"] == prompt_grad
                and r["status"] == "ok"
                and isinstance(r["peak_allocated_bytes"], int)
            ]
            if len(ok) >= 2:
                small, large = min(ok, key=lambda r: r["group"]), max(ok, key=lambda r: r["group"])
                growth.append(
                    {
                        "prompt_len": prompt_len,
                        "prompt_grad": prompt_grad,
                        "groups": [small["group"], large["group"]],
                        "peak_growth_bytes": large["peak_allocated_bytes"]
                        - small["peak_allocated_bytes"],
                    }
                )
    return growth


# --- tiers -------------------------------------------------------------------------------------


def tiers_section(ctx: Context, budget: Budget, record: dict) -> None:
    from longstraw.engine.prefill import prefill

    cfg = ctx.config
    model = ctx.model("qwen3_5", getattr(torch, cfg.scale_dtype), cfg.scale_size)
    prompt, _, _ = _group(model.config.vocab_size, 1, cfg.tiers_prompt_len, ctx.device)
    state = prefill(model, prompt, shard_tokens=cfg.scale_shard_tokens)
    # Exact mode keeps the fp32 cotangent beside the state: the budget is a fraction of both.
    state_bytes = state.state_bytes()
    held = state_bytes + state_bytes * 4 // next(model.parameters()).element_size()
    budget_bytes = int(held * cfg.tiers_budget_fraction)
    rows, resident = record.setdefault("rows", []), None
    for label, extra in (
        ("resident", None),
        ("host tier", {"state_budget_bytes": budget_bytes, "state_tier": "host"}),
    ):
        row = {"config": label, "prompt_len": cfg.tiers_prompt_len, "state_bytes": state_bytes}
        row["budget_bytes"] = None if extra is None else budget_bytes
        row["pinned_host"] = torch.cuda.is_available() if extra else None
        reason = budget.skip_reason(rows[0]["step_s"] * 3 if rows and "step_s" in rows[0] else None)
        if reason is not None:
            rows.append({**row, "status": reason})
            continue
        try:
            measured, buffer = _step(ctx, model, state, cfg.tiers_group, "exact", extra)
            row.update(measured, status="ok")
            if resident is None:
                resident = buffer.grads
            else:
                # docs/engine.md: a streamed state gives the resident gradients bit for bit.
                row["grad_max_abs_diff"] = max(
                    float((buffer.grads[n] - resident[n]).abs().max()) for n in resident
                )
                row["status"] = "ok" if row["grad_max_abs_diff"] == 0.0 else "mismatch"
        except Exception as exc:
            row["status"] = _error(exc)
        rows.append(row)
        ctx.release()
    record["status"] = _rows_status(rows)


SECTION_FUNCTIONS = {
    "kernels": kernels_section,
    "parity": parity_section,
    "exact_gradient": exact_gradient_section,
    "scale": scale_section,
    "tiers": tiers_section,
}


# --- the report ----------------------------------------------------------------------------------


def _torch_flags() -> dict:
    """Process-wide torch settings a check could change by accident (compared before / after)."""
    flags = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
    }
    if torch.cuda.is_available():
        flags["cuda_current_device"] = torch.cuda.current_device()
    return flags


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return _error(exc)
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def environment(device: torch.device) -> dict:
    """Versions of what runs the check: Python, torch and its CUDA, transformers, the kernel
    packages (None: not installed); on CUDA the card, its capability and memory, the driver."""
    import transformers

    from longstraw.models.kernels import GPU_KERNELS

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "kernel_packages": {
            dist: _installed_version(dist) for dist in (*GPU_KERNELS.values(), "triton")
        },
        "device": str(device),
        "cuda_available": torch.cuda.is_available(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "cublas_workspace_config_set_by_selfcheck": _CUBLAS_SET_HERE,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            device_memory_bytes=props.total_memory,
            driver=_driver_version(),
        )
    return env


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    """Markdown table of `rows`: (header, key) per column; a byte count shown in GiB, a list
    joined by arrows."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for header, key in columns:
            value = row.get(key)
            if "GiB" in header and isinstance(value, int):
                value = value / _GIB
            elif isinstance(value, list):
                value = " → ".join(map(str, value))
            cells.append(_cell(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# (title, section, rows key, [(column header, row key)]): the markdown's tables, in order.
_TABLES = [
    ("Sections", None, None,
     [("section", "section"), ("status", "status"), ("reason", "reason"),
      ("seconds", "seconds"), ("budget s", "budget_s")]),
    ("Kernels", "kernels", "packages",
     [("package", "package"), ("installed", "installed"), ("version", "version"),
      ("import", "import")]),
    (None, "kernels", "transformers_bindings",
     [("transformers function", "key"), ("bound to", "value")]),
    (None, "kernels", "kernels_ran", [("layer kind", "key"), ("kernel that ran", "value")]),
    ("Log-prob parity against transformers", "parity", "rows",
     [("family", "family"), ("dtype", "dtype"), ("device", "device"), ("P", "prompt_len"),
      ("max abs diff of log p", "max_abs_diff"), ("tolerance", "tolerance"),
      ("status", "status")]),
    ("Exact gradient against float64 autograd", "exact_gradient", "rows",
     [("family", "family"), ("device", "device"), ("P", "prompt_len"),
      ("worst parameter", "worst_parameter"), ("its rel. error", "worst_rel_error"),
      ("error / bar", "worst_over_bar"), ("max rel. error", "max_rel_error"),
      ("status", "status")]),
    ("Scale: small Qwen3.5 hybrid", "scale", "prefill",
     [("P", "prompt_len"), ("dtype", "dtype"), ("prefill s", "prefill_s"),
      ("tokens/s", "prefill_tokens_per_s"), ("state GiB", "state_bytes"),
      ("peak GiB", "peak_allocated_bytes"), ("status", "status")]),
    (None, "scale", "rows",
     [("P", "prompt_len"), ("mode", "prompt_grad"), ("G", "group"), ("replay s", "replay_s"),
      ("sweep s", "sweep_s"), ("step s", "step_s"), ("peak GiB", "peak_allocated_bytes"),
      ("status", "status")]),
    (None, "scale", "group_growth",
     [("P", "prompt_len"), ("mode", "prompt_grad"), ("G", "groups"),
      ("peak growth GiB", "peak_growth_bytes")]),
    ("State tiers: budget below the state", "tiers", "rows",
     [("config", "config"), ("P", "prompt_len"), ("state GiB", "state_bytes"),
      ("budget GiB", "budget_bytes"), ("step s", "step_s"),
      ("peak GiB", "peak_allocated_bytes"), ("resident peak GiB", "peak_resident_bytes"),
      ("read GiB", "bytes_read"), ("written GiB", "bytes_written"),
      ("grad max diff", "grad_max_abs_diff"), ("status", "status")]),
]  # fmt: skip


def markdown(report: dict) -> str:
    """The report as markdown: a header line and the tables of `_TABLES` that have data."""
    env, sections = report["environment"], report["sections"]
    lines = [
        "# LongStraw GPU self-check",
        "",
        f"mode `{report['mode']}`, device `{env['device']}` {env.get('device_name', '')}, "
        f"driver {env.get('driver')}, torch {env['torch']} (CUDA {env.get('cuda')}), "
        f"transformers {env['transformers']}; "
        f"{report['seconds']:.0f} s; torch settings unchanged: {report['settings_unchanged']}",
    ]
    for title, section, key, columns in _TABLES:
        if section is None:
            rows = [{"section": name, **record} for name, record in sections.items()]
        else:
            rows = sections.get(section, {}).get(key)
        if rows is None:
            continue
        if isinstance(rows, dict):
            rows = [{"key": k, "value": v} for k, v in rows.items()]
        lines += [""] + ([f"## {title}", ""] if title else [])
        lines += _table(rows, columns)
    return "\n".join(lines) + "\n"


def _import_engine() -> None:
    """Import what every section uses before any section's clock starts: a cold import of the
    engine and transformers' modeling code takes seconds (over 10 on a loaded 2-core CPU),
    which is no section's work and would eat a short budget."""
    import longstraw.engine
    import longstraw.models.checkpoint
    import longstraw.models.factory  # noqa: F401


def run(config: SelfCheckConfig, device: torch.device, out: Path, sections, mode: str) -> dict:
    """Run `sections` in order, writing the JSON and markdown after each; returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    _import_engine()
    before = _torch_flags()
    started = time.perf_counter()
    report = {
        "mode": mode,
        "config": config.model_dump(),
        "environment": environment(device),
        "sections": {},
    }
    with tempfile.TemporaryDirectory(prefix="longstraw-selfcheck-") as scratch:
        ctx = Context(config, device, Path(scratch))
        for name in sections:
            report["sections"][name] = run_section(name, SECTION_FUNCTIONS[name], ctx)
            after = _torch_flags()
            report.update(
                seconds=time.perf_counter() - started,
                torch_flags_before=before,
                torch_flags_after=after,
                settings_unchanged=before == after,
            )
            (out / "gpu_selfcheck.json").write_text(json.dumps(report, indent=1, default=str))
            (out / "gpu_selfcheck.md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny prompts and models: seconds")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument(
        "--scale-lengths", type=int, nargs="+", help="prompt lengths of the scale section"
    )
    parser.add_argument(
        "--budget", action="append", default=[], metavar="SECTION=SECONDS",
        help="a section's time budget, e.g. --budget scale=300 (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = SMOKE if args.smoke else FULL
    budgets = dict(config.budgets_s)
    for item in args.budget:
        section, _, seconds = item.partition("=")
        if section not in SECTIONS:
            parser.error(f"--budget {item}: the section must be one of {', '.join(SECTIONS)}")
        budgets[section] = float(seconds)
    update = {"budgets_s": budgets}
    if args.scale_lengths:
        update["scale_lengths"] = tuple(args.scale_lengths)
    config = SelfCheckConfig.model_validate({**config.model_dump(), **update})
    report = run(config, device, args.out, args.sections, "smoke" if args.smoke else "full")
    for name, section in report["sections"].items():
        print(f"{name}: {section['status']} ({section['seconds']:.1f} s)")
    print(f"wrote {args.out / 'gpu_selfcheck.json'} and {args.out / 'gpu_selfcheck.md'}")
    return report


if __name__ == "__main__":
    main()
