"""`longstraw bench ...`: run the benchmark suites, write JSON results, draw the plots.

Each configuration runs in its own process under `--time-cap` seconds and `--mem-cap-gib`; the
results go to `bench/results/<suite>.json` and the plots to `docs/img/`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

bench_app = typer.Typer(help="Benchmarks: LongStraw vs full-sequence GRPO, TRL, a plain forward.")

_GIB = 2**30
CKPT_ROOT = Path(".longstraw/bench")
RESULTS = Path("bench/results")


def _suites():
    """`bench.grpo.suites`, imported when a benchmark runs (it loads torch): the `bench`
    commands' --help answers without it."""
    from bench.grpo import suites

    return suites


def _progress(record: dict) -> None:
    spec = record["spec"]
    peak = _suites().peak_of(record) / _GIB if record["status"] != "skipped" else 0.0
    step = record.get("result", {}).get("step_s")
    step_text = f"{step:8.1f} s" if step is not None else " " * 10
    typer.echo(
        f"{spec['method']:>20} P={spec['prompt_tokens']:>7} G={spec['group_size']:>2} "
        f"{record['status']:>8} step {step_text} peak {peak:6.2f} GiB "
        f"{record.get('reason', '')}"
    )


def _write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    typer.echo(f"wrote {out}")


def _checkpoint(checkpoint: Path | None) -> str:
    from bench.grpo.workload import ensure_checkpoint

    return str(checkpoint if checkpoint is not None else ensure_checkpoint(CKPT_ROOT))


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


@bench_app.command()
def prefill(
    prompt_tokens: int = 32768,
    shard_tokens: int = 2048,
    checkpoint: Path | None = typer.Option(None, help="default: the small qwen3_5 checkpoint"),
    time_cap: float = 900.0,
    mem_cap_gib: float = 16.0,
    out: Path = RESULTS / "prefill.json",
) -> None:
    """Prefill tokens/s and peak RSS against transformers' plain forward (no grad, sdpa)."""
    result = _suites().prefill_suite(
        _checkpoint(checkpoint),
        prompt_tokens=prompt_tokens,
        shard_tokens=shard_tokens,
        time_cap_s=time_cap,
        mem_cap_bytes=int(mem_cap_gib * _GIB),
        progress=_progress,
    )
    _write(result, out)


@bench_app.command()
def group(
    prompt_tokens: int = 32768,
    group_sizes: str = "2,4,8,16",
    methods: str = "longstraw-detached,longstraw-exact",
    shard_tokens: int = 2048,
    checkpoint: Path | None = typer.Option(None, help="default: the small qwen3_5 checkpoint"),
    time_cap: float = 900.0,
    mem_cap_gib: float = 16.0,
    out: Path = RESULTS / "group.json",
) -> None:
    """Peak RSS against the group size G at a fixed prompt length."""
    result = _suites().group_suite(
        _checkpoint(checkpoint),
        prompt_tokens=prompt_tokens,
        group_sizes=_ints(group_sizes),
        methods=methods.split(","),
        shard_tokens=shard_tokens,
        time_cap_s=time_cap,
        mem_cap_bytes=int(mem_cap_gib * _GIB),
        progress=_progress,
    )
    _write(result, out)


@bench_app.command()
def context(
    prompt_lengths: str = "4096,8192,16384,32768,65536,131072",
    group_size: int = 8,
    methods: str = "longstraw-detached,longstraw-exact,full-sequence",
    shard_tokens: int = 2048,
    checkpoint: Path | None = typer.Option(None, help="default: the small qwen3_5 checkpoint"),
    time_cap: float = 600.0,
    mem_cap_gib: float = 16.0,
    out: Path = RESULTS / "context.json",
) -> None:
    """Peak RSS and step time against P at fixed G, each method until a cap stops it."""
    result = _suites().context_suite(
        _checkpoint(checkpoint),
        prompt_lengths=_ints(prompt_lengths),
        group_size=group_size,
        methods=methods.split(","),
        shard_tokens=shard_tokens,
        time_cap_s=time_cap,
        mem_cap_bytes=int(mem_cap_gib * _GIB),
        progress=_progress,
    )
    _write(result, out)


@bench_app.command()
def fidelity(
    prompt_tokens: int = 641,
    group_size: int = 4,
    shard_tokens: int = 160,
    checkpoint: Path | None = typer.Option(None, help="default: the small qwen3_5 checkpoint"),
    time_cap: float = 900.0,
    mem_cap_gib: float = 16.0,
    out: Path = RESULTS / "fidelity.json",
) -> None:
    """Cosine and relative error of each method's gradient to the exact full-sequence gradient."""
    result = _suites().fidelity_suite(
        _checkpoint(checkpoint),
        prompt_tokens=prompt_tokens,
        group_size=group_size,
        shard_tokens=shard_tokens,
        time_cap_s=time_cap,
        mem_cap_bytes=int(mem_cap_gib * _GIB),
        progress=_progress,
    )
    for method, row in result["summary"].items():
        typer.echo(f"{method:>20} {row}")
    _write(result, out)


@bench_app.command()
def rollout(
    prompt_lengths: str = "4096,8192",
    group_size: int = 8,
    response_tokens: int = 32,
    repeats: int = 2,
    shard_tokens: int = 2048,
    checkpoint: Path | None = typer.Option(None, help="default: the small qwen3_5 checkpoint"),
    time_cap: float = 900.0,
    mem_cap_gib: float = 16.0,
    out: Path = RESULTS / "rollout.json",
) -> None:
    """LongStraw's prefill + sampling against TRL's generation, alternated (own processes)."""
    result = _suites().rollout_suite(
        _checkpoint(checkpoint),
        prompt_lengths=_ints(prompt_lengths),
        group_size=group_size,
        response_tokens=response_tokens,
        repeats=repeats,
        shard_tokens=shard_tokens,
        time_cap_s=time_cap,
        mem_cap_bytes=int(mem_cap_gib * _GIB),
        progress=_progress,
    )
    for p, point in result["summary"]["points"].items():
        typer.echo(f"P={p}: TRL / LongStraw = {point.get('ratio_trl_over_longstraw')}")
    _write(result, out)


@bench_app.command()
def decode(
    prompt_lengths: str = "2048,8192,32768,65536",
    group_sizes: str = "1,2,4,8,16",
    response_tokens: int = 32,
    repeats: int = 3,
    reference_tokens: int = typer.Option(
        2048, help="also decode from the first N prompt tokens' state, alternated (0: off)"
    ),
    shard_tokens: int = 2048,
    checkpoint: Path | None = typer.Option(None, help="default: the small qwen3_5 checkpoint"),
    time_cap: float = 1800.0,
    mem_cap_gib: float = 16.0,
    out: Path = RESULTS / "decode.json",
) -> None:
    """The time of one decoding step against P and G (sampling included)."""
    result = _suites().decode_suite(
        _checkpoint(checkpoint),
        prompt_lengths=_ints(prompt_lengths),
        group_sizes=_ints(group_sizes),
        response_tokens=response_tokens,
        repeats=repeats,
        reference_tokens=reference_tokens,
        shard_tokens=shard_tokens,
        time_cap_s=time_cap,
        mem_cap_bytes=int(mem_cap_gib * _GIB),
        progress=_progress,
    )
    for p, row in result["summary"]["decode_step_s"].items():
        typer.echo(f"P={p}: " + ", ".join(f"G={g} {1e3 * s:.1f} ms" for g, s in row.items()))
    for p, row in result["summary"].get("ratio_to_reference_same_process", {}).items():
        typer.echo(
            f"P={p} / P={reference_tokens}: " + ", ".join(f"G={g} {r:.2f}" for g, r in row.items())
        )
    _write(result, out)


@bench_app.command()
def plot(
    results: Path = RESULTS,
    out_dir: Path = Path("docs/img"),
    context: str = typer.Option(
        "", help="comma-separated context JSON files to merge (first file's cap and G)"
    ),
    group: Path | None = typer.Option(None, help="the group JSON file to draw"),
) -> None:
    """Draw the PNG plots of docs/benchmarks.md from the JSON results."""
    from bench.grpo.plots import draw_all

    files = [Path(name) for name in context.split(",") if name]
    for path in draw_all(results, out_dir, context=files or None, group=group):
        typer.echo(f"wrote {path}")


@bench_app.command()
def report(results: Path = RESULTS) -> None:
    """Print the markdown tables of docs/benchmarks.md from the JSON results."""
    from bench.grpo.report import render

    typer.echo(render(results))


if __name__ == "__main__":
    bench_app()
