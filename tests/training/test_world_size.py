"""`parallel.world_size: 2` end to end: `longstraw train` on two CPU ranks (gloo) trains what one
process trains (`--no-prefect`, the Prefect flow, torchrun's ranks; segments and shared prefixes,
a state budget, an agent's multi-turn rollout), and a rank killed mid-step leaves a run that
`--resume` finishes without recomputing committed prefill shards.

Legend: the tiny qwen3_5 hybrid, a 64-token prompt (63 state tokens in 3 shards of 23), exact
prompt gradient, G = 3, two groups per step.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file

from longstraw.distributed.launch import free_port
from longstraw.storage.checkpoints import latest_checkpoint, load_optimizer_rows
from longstraw.training.loop import train
from longstraw.training.metrics import read_metrics
from tests.training.helpers import run_config

pytestmark = [pytest.mark.processes, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 2
# Two ranks sum the same fp32 terms in another order (cross-rank log-sum-exp merges, an
# all-reduce of the sweep's partial gradients): one group's gradients agree to ≤ 1.6e-5 relative
# per tensor (the Gated DeltaNet decay parameters; ≤ 3e-6 for every other tensor).
RELATIVE_TOLERANCE = 1e-5
"""Per tensor, ‖w₂ − w₁‖ / ‖w₁‖ of the final weights."""
UPDATE_TOLERANCE = 1e-4
"""Per tensor, ‖Δw₂ − Δw₁‖ / ‖Δw₁‖ of what training moved (Δw = final − initial weights)."""
ADAM_EPSILON = 1e-3
"""At Adam's first steps an update is lr · g / (|g| + ε): with TRL's ε = 1e-8 every entry moves
by ±lr whatever its size, so an entry whose gradient is ~1e-9 flips sign under any reordering
and moves 2·lr the other way (measured: 5e-4 relative on `in_proj_a` after one step). With
larger ε, entries below it move in proportion to their gradient: the comparison measures the
gradients' agreement, not a sign coin. ε = 1e-4 still left the agent run's two steps (exact
mode, tool output masked) at the fp32 noise floor: one process against two ranks, final
`layers.0.input_layernorm` 0.84e-5 relative on one machine and 1.78e-5 on another (an AMD EPYC
without AVX-512), deterministic on each, while the step's gradients of both paths agree with
float64 autograd to 8.4e-7. At 1e-3 the weights and the scale-free update check below pass on
the second machine as well."""


def _config(root: Path, checkpoint: Path, run_id: str):
    return run_config(
        root,
        checkpoint,
        run_id=run_id,
        num_steps=NUM_STEPS,
        grpo={"num_generations": 3, "beta": 0.04, "adam_epsilon": ADAM_EPSILON},
        data={"rewards": ["tests.training.helpers:checksum_reward"]},
        persist_mode="synchronous",
    )


def _yaml(path: Path, config, world_size: int, data_parallel: int = 1) -> Path:
    raw = config.model_dump(mode="json")
    raw["parallel"] = {
        "world_size": world_size,
        "data_parallel": data_parallel,
        "backend": "gloo",
        "timeout_s": 120,
    }
    path.write_text(yaml.safe_dump(raw))
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    home = tmp_path / "prefect"
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_LOCAL_STORAGE_PATH=str(home / "results"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        **extra,
    )
    return env


def _train(config_path: Path, cwd: Path, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "longstraw.cli", "train", "--config", str(config_path), *extra],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _kill_spawned_ranks_when(
    process: subprocess.Popen, ready: Callable[[], bool], never: str
) -> tuple[str, list[psutil.Process]]:
    """SIGKILL the ranks `process` spawned once `ready()` (failing with `never` after 600 s);
    (the process's output once it has ended, every process that was below it)."""
    try:
        deadline = time.monotonic() + 600
        while not ready():
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, never
            time.sleep(0.05)
        ranks = psutil.Process(process.pid).children(recursive=True)
        rank_1 = [p for p in ranks if "multiprocessing" in " ".join(p.cmdline())]
        assert len(rank_1) >= 1, [p.cmdline() for p in ranks]
        for p in rank_1:
            p.send_signal(signal.SIGKILL)
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return out.decode(), ranks


def _assert_sharded_optimizer_state(checkpoint: Path, reference: Path) -> None:
    """`checkpoint`'s optimizer state is split by rows over two rank files (each rank held and
    wrote only its shard), and reassembled it is the single-process state."""
    parts = [load_file(str(checkpoint / f"optimizer-rank{r}-of-2.safetensors")) for r in (0, 1)]
    assert not (checkpoint / "optimizer.safetensors").exists()
    whole = load_optimizer_rows(checkpoint)
    single = load_file(str(reference / "optimizer.safetensors"))
    assert whole.keys() == single.keys() == parts[0].keys()
    moments = [key for key in single if key.startswith("exp_avg_sq/")]
    assert moments, "no AdamW second moments: nothing to compare"
    for key in moments:
        dim0 = single[key].shape[0]
        first = min(-(-dim0 // 2), dim0)  # torch.chunk's layout, FSDP2's shards
        assert [part[key].shape[0] for part in parts] == [first, dim0 - first], key
        relative = float((whole[key] - single[key]).norm() / single[key].norm())
        assert relative <= UPDATE_TOLERANCE, f"{key}: second moments differ by {relative:.3e}"


def _assert_same_checkpoint(a: Path, b: Path, start: Path) -> None:
    """`a` and `b` hold the same weights per tensor, and moved the same way from `start`."""
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    initial = load_file(str(start / "model.safetensors"))
    assert left.keys() == right.keys()
    moved = 0
    for name, x in left.items():
        y, x0 = right[name], initial[name]
        relative = float((x - y).norm() / y.norm())
        assert relative <= RELATIVE_TOLERANCE, f"{name}: weights differ by {relative:.3e}"
        step = (y - x0).norm()
        if step > 0:
            moved += 1
            relative = float(((x - x0) - (y - x0)).norm() / step)
            assert relative <= UPDATE_TOLERANCE, f"{name}: updates differ by {relative:.3e}"
    assert moved == len(left), "some tensor never moved: its comparison would be vacuous"


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, checkpoint_dir):
    """The reference: the same run in one process (world_size 1)."""
    root = tmp_path_factory.mktemp("world1")
    config = _config(root, checkpoint_dir("qwen3_5"), "ranks")
    outcome = train(config)
    assert any(m.grad_norm > 0 for m in outcome.history), "nothing trained: no signal to compare"
    return config, latest_checkpoint(config.storage, config.run_id), outcome.history


def _algorithm(m) -> dict:
    return {
        "step": m.step,
        "policy_version": m.policy_version,
        "reward_mean": m.reward_mean,
        "completion_tokens": m.completion_tokens,
        "num_groups": m.num_groups,
    }


def test_rank_killed_mid_step_then_resume_on_the_flow_ends_with_the_single_process_checkpoint(
    tmp_path, checkpoint_dir, single_process, fresh_prefect_home
):
    """Two ranks (`--no-prefect`) until rank 1 is SIGKILLed inside step 1, after its prompt
    states were committed; `--resume` on the Prefect flow (embedded API), with its stages on two
    ranks, finishes the run: committed shards are read back, and the checkpoint, the optimizer's
    row shards and every step's metrics are the single process's."""
    _, reference_checkpoint, reference_history = single_process
    root = tmp_path / "root"
    config = _config(root, checkpoint_dir("qwen3_5"), "ranks")
    path = _yaml(tmp_path / "run.yaml", config, world_size=2)
    run_dir = root / "runs" / "ranks"
    # Slow rewards hold step 1 open after its prompt states are committed (same values); step
    # 0's rewards (two groups of G = 3, scored on rank 0) are not delayed.
    slow = _env(
        tmp_path,
        LONGSTRAW_TEST_REWARD_DELAY_S="1.0",
        LONGSTRAW_TEST_REWARD_DELAY_AFTER_CALLS=str(2 * 3),
    )
    process = _train(path, tmp_path, slow, "--no-prefect")
    text, ranks = _kill_spawned_ranks_when(
        process,
        lambda: len(list(run_dir.glob("policy-v1/prompts/*/COMMITTED.json"))) >= 2,
        "step 1's prompt states were never committed",
    )
    assert process.returncode != 0, text[-3000:]
    assert "rank 1" in text, text[-3000:]
    assert not (run_dir / "checkpoints" / f"v{NUM_STEPS:06d}").exists()
    # No rank outlives the failed run.
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    fresh_prefect_home(tmp_path / "prefect")
    resumed = _train(path, tmp_path, _env(tmp_path), "--resume")
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out.decode()[-4000:]

    checkpoint = latest_checkpoint(config.storage, config.run_id)
    assert checkpoint.name == reference_checkpoint.name == f"v{NUM_STEPS:06d}"
    _assert_same_checkpoint(checkpoint, reference_checkpoint, checkpoint_dir("qwen3_5"))
    _assert_sharded_optimizer_state(checkpoint, reference_checkpoint)
    history = read_metrics(run_dir)
    assert [_algorithm(m) for m in history] == [_algorithm(m) for m in reference_history]
    for two, one in zip(history, reference_history, strict=True):
        assert two.loss == pytest.approx(one.loss, rel=1e-4, abs=1e-7)
        assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
        assert two.kl == pytest.approx(one.kl, rel=1e-3, abs=1e-8)
        # Replay and the exact sweep are timed apart on the ranks too.
        assert two.seconds["replay"] > 0 and two.seconds["sweep"] > 0, two.seconds
    assert (history[0].shards_computed, history[0].shards_reused) == (2 * 3, 0)
    # Step 1's states were committed before the kill: read back, not recomputed.
    assert (history[1].shards_computed, history[1].shards_reused) == (0, 2 * 3)
    # One cacheable prefill task per shard on the ranks (the resumed step: 2 groups x 3 shards).
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        names = [name for (name,) in db.execute("SELECT name FROM task_run")]
    shard_tasks = [n for n in names if n.startswith("prefill s")]
    assert len(shard_tasks) == 2 * 3, sorted(names)
    assert sorted({n.split()[1] for n in shard_tasks}) == ["s0/3", "s1/3", "s2/3"]


@pytest.mark.parametrize("data_parallel", [1, 2], ids=["one-replica", "two-replicas"])
def test_torchrun_two_nodes_on_loopback_train_the_single_process_step(
    data_parallel, tmp_path, checkpoint_dir, single_process
):
    """Ranks from torchrun's c10d rendezvous (two "nodes" of one process each, on this machine)
    run `longstraw train`: rank 0 drives, rank 1 serves; one step equals the single process's.
    Each "node" streams its slice under a state budget of 0 from its own scratch directory —
    one prompt's slice each (one replica of two sequence ranks), or its own groups' whole
    states (two replicas of one rank: a node per replica)."""
    _, reference_checkpoint, reference_history = single_process
    root = tmp_path / "root"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    base = _config(root, checkpoint_dir("qwen3_5"), "ranks")
    budget = {"state_budget_bytes": 0, "state_tier": "disk", "state_dir": str(scratch)}
    config = base.model_copy(update={"engine": base.engine.model_copy(update=budget)})
    path = _yaml(tmp_path / "run.yaml", config, world_size=2, data_parallel=data_parallel)
    port = free_port()
    env = _env(tmp_path, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    nodes = [
        subprocess.Popen(
            [
                str(Path(sys.executable).with_name("torchrun")),
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=longstraw-test",
                "--max-restarts=0",
                "-m",
                "longstraw.cli",
                "train",
                "--config",
                str(path),
                "--steps",
                "1",
                "--no-prefect",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=600)[0].decode() for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    for node, out in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, out[-4000:]
    (metrics,) = read_metrics(root / "runs" / "ranks")
    assert _algorithm(metrics) == _algorithm(reference_history[0])
    # Each rank streamed its slice of the state and of dS from its scratch file (rollout,
    # scoring, the backward), which one process with the whole state resident never does.
    assert metrics.state_bytes_read > 0 and metrics.state_bytes_written > 0, metrics
    assert metrics.state_peak_resident_bytes is not None, metrics
    assert metrics.state_peak_resident_bytes > 0, metrics
    assert reference_history[0].state_bytes_read == 0
    assert not list(scratch.iterdir()), "scratch files left behind"
    checkpoint = latest_checkpoint(config.storage, config.run_id)
    assert checkpoint.name == "v000001"
    _assert_same_checkpoint(
        checkpoint, reference_checkpoint.with_name("v000001"), checkpoint_dir("qwen3_5")
    )


def test_segments_and_shared_prefixes_on_two_ranks_end_with_the_single_process_checkpoint(
    tmp_path, checkpoint_dir
):
    # Segments of 4 tokens and the prefix tree (both were refused on several ranks): `longstraw
    # train --no-prefect` on two ranks against the same run in one process. Completions of up
    # to 9 tokens: a full-length one replays in three segments.
    def config(root: Path):
        base = _config(root, checkpoint_dir("qwen3_5"), "branches")
        engine = {"branch_segment_tokens": 4, "share_response_prefixes": True}
        grpo = {"max_completion_length": 9}
        return base.model_copy(
            update={
                "engine": base.engine.model_copy(update=engine),
                "grpo": base.grpo.model_copy(update=grpo),
            }
        )

    single = config(tmp_path / "world1")
    reference = train(single).history
    ranks = config(tmp_path / "world2")
    process = _train(
        _yaml(tmp_path / "run.yaml", ranks, 2), tmp_path, _env(tmp_path), "--no-prefect"
    )
    out, _ = process.communicate(timeout=900)
    assert process.returncode == 0, out.decode()[-4000:]
    _assert_same_checkpoint(
        latest_checkpoint(ranks.storage, ranks.run_id),
        latest_checkpoint(single.storage, single.run_id),
        checkpoint_dir("qwen3_5"),
    )
    history = read_metrics(tmp_path / "world2" / "runs" / "branches")
    assert [_algorithm(m) for m in history] == [_algorithm(m) for m in reference]
    # Responses longer than one segment were sampled (the segmented path really ran).
    lengths = [
        len(ids)
        for path in (tmp_path / "world2").rglob("rollout-g*.json")
        for ids in json.loads(path.read_text())["response_ids"]
    ]
    assert max(lengths) > 4, lengths


def test_agent_run_on_two_ranks_samples_and_trains_what_one_process_does(tmp_path, checkpoint_dir):
    # examples/agent.yaml (multi-turn rollout with the key-lookup tool, exact mode, segments of
    # 16 tokens; it was refused on several ranks), two steps of one group, `longstraw train
    # --no-prefect` on two ranks against one process.
    from longstraw.schemas.run import merged, validated_run_config
    from longstraw.training.stages import RolloutRecord

    example = REPO / "examples" / "agent.yaml"

    def config(root: Path):
        raw = merged(
            yaml.safe_load(example.read_text()),
            {
                "model": {"checkpoint": str(checkpoint_dir("qwen3_5"))},
                "grpo": {"adam_epsilon": ADAM_EPSILON},
                "storage": {"root_uri": str(root), "persist_mode": "synchronous"},
                "train": {"num_steps": 2, "groups_per_step": 1, "checkpoint_every": 2},
            },
        )
        return validated_run_config(raw, str(example))

    single = config(tmp_path / "world1")
    reference = train(single).history
    ranks = config(tmp_path / "world2")
    process = _train(
        _yaml(tmp_path / "run.yaml", ranks, 2), tmp_path, _env(tmp_path), "--no-prefect"
    )
    out, _ = process.communicate(timeout=900)
    assert process.returncode == 0, out.decode()[-4000:]
    _assert_same_checkpoint(
        latest_checkpoint(ranks.storage, ranks.run_id),
        latest_checkpoint(single.storage, single.run_id),
        checkpoint_dir("qwen3_5"),
    )
    history = read_metrics(tmp_path / "world2" / "runs" / ranks.run_id)
    assert [_algorithm(m) for m in history] == [_algorithm(m) for m in reference]
    assert [m.turns_mean for m in history] == [m.turns_mean for m in reference]
    assert all(m.turns_mean > 1 and m.environment_errors == 0 for m in history), history
    records = {
        world: [
            RolloutRecord.model_validate_json(path.read_text())
            for path in sorted((tmp_path / world).rglob("rollout-g*.json"))
        ]
        for world in ("world1", "world2")
    }
    assert len(records["world2"]) == 2
    for two, one in zip(records["world2"], records["world1"], strict=True):
        for field in ("response_ids", "loss_masks", "rewards", "finish_reasons", "num_turns"):
            assert getattr(two, field) == getattr(one, field), field
        assert any(0 in mask for mask in two.loss_masks), "no tool output was fed"
