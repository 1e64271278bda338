"""PNG plots for docs/benchmarks.md from the suites' JSON results (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path

_GIB = 2**30
_STYLE = {
    "longstraw-exact": dict(color="tab:blue", marker="o"),
    "longstraw-detached": dict(color="tab:green", marker="s"),
    "full-sequence": dict(color="tab:red", marker="^"),
    "trl": dict(color="tab:purple", marker="v"),
}


def _load(results: Path, suite: str) -> dict | None:
    path = results / f"{suite}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _plot_context(data: dict, out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    methods: dict[str, list[dict]] = {}
    for record in data["runs"]:
        methods.setdefault(record["spec"]["method"], []).append(record)
    for method, records in methods.items():
        ok = sorted(
            (r for r in records if r["status"] == "ok"), key=lambda r: r["spec"]["prompt_tokens"]
        )
        xs = [r["spec"]["prompt_tokens"] for r in ok]
        style = _STYLE.get(method, {})
        ax_mem.plot(xs, [r["result"]["peak_rss_bytes"] / _GIB for r in ok], label=method, **style)
        ax_time.plot(xs, [r["result"]["step_s"] for r in ok], label=method, **style)
        for r in records:
            if r["status"] in ("oom", "timeout"):
                ax_mem.annotate(
                    r["status"], (r["spec"]["prompt_tokens"], r["observed_peak_rss_bytes"] / _GIB)
                )
    any_ok = any(r["status"] == "ok" for r in data["runs"])
    cap = data["summary"]["mem_cap_bytes"] / _GIB
    ax_mem.axhline(cap, color="gray", linestyle="--", label=f"cap {cap:.0f} GiB")
    for ax, label in ((ax_mem, "peak RSS (GiB)"), (ax_time, "step time (s)")):
        if any_ok:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens P")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    if any_ok:
        ax_time.set_yscale("log")
    ax_mem.legend(fontsize=8)
    fig.suptitle(f"G = {data['summary']['group_size']}, small Qwen3.5 hybrid, fp32, CPU")
    fig.tight_layout()
    path = out_dir / "bench_context.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_group(data: dict, out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, row in data["summary"]["methods"].items():
        gs = sorted(row["peak_rss_bytes"], key=int)
        ax.plot(
            [int(g) for g in gs],
            [row["peak_rss_bytes"][g] / _GIB for g in gs],
            label=method,
            **_STYLE.get(method, {}),
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("group size G")
    ax.set_ylabel("peak RSS (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"P = {data['summary']['prompt_tokens']}")
    fig.tight_layout()
    path = out_dir / "bench_group.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_prefill(data: dict, out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    s = data["summary"]
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(8, 3.5))
    names = ["LongStraw prefill", "transformers forward"]
    ax_speed.bar(
        names, [s["prefill_tokens_per_s"], s["hf_tokens_per_s"]], color=["tab:blue", "tab:gray"]
    )
    ax_speed.set_ylabel("tokens/s")
    ax_mem.bar(
        names,
        [s["prefill_peak_rss_bytes"] / _GIB, s["hf_peak_rss_bytes"] / _GIB],
        color=["tab:blue", "tab:gray"],
    )
    ax_mem.set_ylabel("peak RSS (GiB)")
    fig.suptitle(f"prompt of {s['prompt_tokens']} tokens, no grad")
    fig.tight_layout()
    path = out_dir / "bench_prefill.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def merge_context_runs(paths: list[Path]) -> dict:
    """One context suite from several runs: the first file's summary (cap, G) and, for each
    (method, P), the first record that ran ("ok"), else the first record at all."""
    loaded = [json.loads(path.read_text()) for path in paths]
    chosen: dict[tuple[str, int], dict] = {}
    for data in loaded:
        for record in data["runs"]:
            key = (record["spec"]["method"], record["spec"]["prompt_tokens"])
            if key not in chosen or (chosen[key]["status"] != "ok" and record["status"] == "ok"):
                chosen[key] = record
    return {"summary": loaded[0]["summary"], "runs": list(chosen.values())}


def draw_all(
    results: Path, out_dir: Path, *, context: list[Path] | None = None, group: Path | None = None
) -> list[Path]:
    """Every plot whose JSON exists under `results`; returns the PNG paths written.

    `context` / `group` name the runs to draw (default: context.json + context_*.json, and
    group.json), so a plot can show the latest runs only.
    """
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for suite, draw in (
        ("context", _plot_context),
        ("group", _plot_group),
        ("prefill", _plot_prefill),
    ):
        if suite == "context" and context:
            data = merge_context_runs(context)
        elif suite == "group" and group is not None:
            data = json.loads(group.read_text())
        else:
            data = _load(results, suite)
            if data is not None and suite == "context":
                # Extra lengths measured by separate invocations (context_*.json) join the plot.
                for extra in sorted(results.glob("context_*.json")):
                    data["runs"] = data["runs"] + json.loads(extra.read_text())["runs"]
        if data is not None and data.get("summary"):
            written.append(draw(data, out_dir))
    return written
