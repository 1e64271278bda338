"""Storage faults under one rank of `parallel.world_size: 2` end `longstraw train` as they do in
one process (test_storage_faults.py): one `error:` line, exit status 74, no process left behind,
the lease released, nothing half-written, and `--resume` ends on the uninterrupted two-rank run's
final checkpoint, bitwise. A full disk under rank 1 or rank 0 (also on the embedded Prefect
server, and under rank 1 of two torchrun nodes), a read-only volume and a frozen S3 route under
rank 1. The faults are injected into the rank's own write or route (no mount needed)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from fault_runs import (
    REPO,
    S3Proxy,
    assert_one_error_line,
    checkpoint_tensors,
    run_train,
    write_run,
)
from helpers import BUCKET, assert_bitwise_equal

pytestmark = pytest.mark.processes

# Faults under one rank only, every process importing this sitecustomize (the test's directory
# is first on PYTHONPATH):
# - FAULT=full-on-rank:R / read-only-on-rank:R: the write of rank R's optimizer rows into step 1's
#   checkpoint (each rank writes its own part) fails as a full disk (a node's own volume) or a
#   volume remounted read-only does. The other rank is then inside the same stage, in
#   collectives rank R never joins.
# - RANK1_S3_ENDPOINT: rank 1's own route to the S3 endpoint (a node's network path), a proxy
#   whose control file rank 1 sets to FAULT=route-down:<file> / route-frozen:<file> as it writes
#   its part of step 0's checkpoint (no S3 traffic): its next S3 request is step 1's prefill.
#   Rank 0's route stays up.
RANK_FAULTS = """
import errno, os, time

import safetensors.torch

_save_file = safetensors.torch.save_file
_ERRORS = {
    "full-on-rank": (errno.ENOSPC, "No space left on device"),
    "read-only-on-rank": (errno.EROFS, "Read-only file system"),
}


def save_file(tensors, filename, *args, **kwargs):
    kind, _, rank = os.environ.get("FAULT", "").partition(":")
    if kind.startswith("route-") and "/v000001.tmp-" in str(filename) and str(filename).endswith(
        "/optimizer-rank1-of-2.safetensors"
    ):
        with open(rank, "w") as control:  # the proxy's control file
            control.write(kind.removeprefix("route-"))
        time.sleep(0.3)  # the proxy looks every 50 ms
    if kind in _ERRORS and "/v000002.tmp-" in str(filename) and str(filename).endswith(
        f"/optimizer-rank{rank}-of-2.safetensors"
    ):
        raise OSError(*_ERRORS[kind], str(filename))
    return _save_file(tensors, filename, *args, **kwargs)


safetensors.torch.save_file = save_file

if os.environ.get("RANK1_S3_ENDPOINT"):
    import longstraw.storage.paths as paths

    _storage_options = paths.storage_options

    def storage_options(uri, config=None):
        if os.environ.get("LOCAL_RANK") == "1":  # set on a spawned rank before it serves
            config = (config or paths.StorageConfig()).model_copy(
                update={"s3_endpoint_url": os.environ["RANK1_S3_ENDPOINT"]}
            )
        return _storage_options(uri, config)

    paths.storage_options = storage_options
"""


def _two_rank_run(directory: Path, checkpoint: Path, storage: dict) -> None:
    """run.yaml for two gloo ranks and the `RANK_FAULTS` sitecustomize in `directory`."""
    write_run(
        directory,
        checkpoint,
        storage,
        parallel={"world_size": 2, "backend": "gloo", "timeout_s": 300},
    )
    (directory / "sitecustomize.py").write_text(RANK_FAULTS)


def _two_rank_run_with_a_disk_full_hook(directory: Path, checkpoint: Path) -> Path:
    """`_two_rank_run` on a local root; the root."""
    root = directory / "root"
    _two_rank_run(directory, checkpoint, {"root_uri": str(root)})
    return root


@pytest.fixture(scope="module")
def two_rank_final(tmp_path_factory, checkpoint_dir) -> dict[str, torch.Tensor]:
    """The final checkpoint's tensors of the two-rank run uninterrupted (both steps, no fault):
    what every two-rank run below must end on after its `--resume`."""
    directory = tmp_path_factory.mktemp("two-rank-uninterrupted")
    root = _two_rank_run_with_a_disk_full_hook(directory, checkpoint_dir("llama"))
    rc, lines = run_train(directory)
    assert rc == 0, "\n".join(lines)[-4000:]
    return checkpoint_tensors(root / "runs" / "faulty" / "checkpoints" / "v000002")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rank", "prefect"),
    [(1, False), (0, False), pytest.param(1, True, marks=pytest.mark.prefect)],
    ids=["rank1", "rank0", "rank1-prefect"],
)
def test_a_disk_that_fills_under_one_rank_ends_in_the_same_one_line(
    rank, prefect, tmp_path, checkpoint_dir, fresh_prefect_home, request
):
    env = {}
    if prefect:  # the embedded default, its Prefect home beside the run
        home = fresh_prefect_home(tmp_path / "prefect")
        env = {"PREFECT_HOME": str(home), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    root = _two_rank_run_with_a_disk_full_hook(tmp_path, checkpoint_dir("llama"))
    started = time.monotonic()
    fault = f"full-on-rank:{rank}"
    rc, lines = _train_watching_children(tmp_path, fault=fault, prefect=prefect, env=env)
    line = assert_one_error_line(
        rc,
        lines,
        f"no space left on the volume of {root} ",
        f"writing {root}/runs/faulty/checkpoints/v000002/optimizer-rank{rank}-of-2.safetensors",
        "free at least",
        "then continue it with: longstraw train --config run.yaml --resume",
    )
    assert "rank " not in line, line
    # Said when the rank fails, not after parallel.timeout_s.
    assert time.monotonic() - started < 240, time.monotonic() - started
    run = root / "runs" / "faulty"
    assert not (run / "RUN.lock").exists()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["v000001"]
    if rank == 0 or prefect:
        return  # the resume after a rank's fault is one path: run it once, in the first case
    rc, lines = run_train(tmp_path, "--resume", prefect=prefect, env=env)
    assert rc == 0, "\n".join(lines)[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["v000001", "v000002"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert_bitwise_equal(
        checkpoint_tensors(run / "checkpoints" / "v000002"),
        request.getfixturevalue("two_rank_final"),
    )


@pytest.mark.s3
@pytest.mark.slow
def test_an_s3_route_and_a_volume_failing_under_rank_1_each_end_in_one_line(
    tmp_path, s3_env, checkpoint_dir, two_rank_final
):
    """One two-rank run on an S3 root, cut short twice on rank 1, then resumed to the end:
    rank 1's route to the S3 endpoint freezes before step 1 (rank 0's stays up); on `--resume`,
    rank 1's write of its optimizer rows into the local volume (`storage.local_dir`, where an S3
    run's checkpoints are) fails as a read-only file system does; the second `--resume` ends on
    the uninterrupted run's weights and optimizer state, bitwise. Each fault: one `error:` line,
    exit 74, no process left, the lease released, nothing half-written."""
    local = tmp_path / "local"
    proxy = S3Proxy(s3_env, tmp_path / "proxy-mode")
    storage = {
        "root_uri": f"s3://{BUCKET}/{uuid.uuid4().hex}",
        "local_dir": str(local),
        "s3_endpoint_url": s3_env,  # rank 0's route; rank 1's goes through the proxy
        "s3_read_timeout_s": 1,
        "s3_connect_timeout_s": 1,
        "s3_max_attempts": 2,
    }
    _two_rank_run(tmp_path, checkpoint_dir("llama"), storage)
    run = local / "runs" / "faulty"
    try:
        started = time.monotonic()
        rc, lines = _train_watching_children(
            tmp_path, fault=f"route-frozen:{proxy.control}", env={"RANK1_S3_ENDPOINT": proxy.url}
        )
    finally:
        proxy.close()
    assert proxy.sockets, "rank 1 did not use its route"
    assert_one_error_line(
        rc,
        lines,
        f"S3 endpoint {proxy.url} did not answer within 1 s (ReadTimeoutError) at s3://",
        "after 2 attempts",
        "then continue it with: longstraw train --config run.yaml --resume",
    )
    assert "rank " not in lines[-1], lines[-1]
    # Rank 1's bounded wait is said as it happens, on the run's console.
    assert any(w.startswith(f"warning: S3 endpoint {proxy.url} did not answer") for w in lines)
    assert time.monotonic() - started < 150
    assert not (run / "RUN.lock").exists()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["v000001"]

    rc, lines = _train_watching_children(tmp_path, "--resume", fault="read-only-on-rank:1")
    assert_one_error_line(
        rc,
        lines,
        f"{local} is on a read-only file system (EROFS) writing "
        f"{run}/checkpoints/v000002/optimizer-rank1-of-2.safetensors",
        "remount it read-write",
        "then continue it with: longstraw train --config run.yaml --resume",
    )
    assert not (run / "RUN.lock").exists()
    assert not list(run.rglob("*.tmp-*")), "a half-written file was left behind"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["v000001"]

    rc, lines = run_train(tmp_path, "--resume")
    assert rc == 0, "\n".join(lines)[-4000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert_bitwise_equal(checkpoint_tensors(run / "checkpoints" / "v000002"), two_rank_final)


def _train_watching_children(
    cwd: Path, *args: str, fault: str, prefect: bool = False, env: dict | None = None
) -> tuple[int, list[str]]:
    """`_train`, asserting that no process it started (ranks, Prefect's server) outlives it."""
    import psutil

    path = os.pathsep.join([str(cwd), str(REPO), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "longstraw.cli", "train", "--config", "run.yaml", *args]
    log = (cwd / "train.log").open("w+")
    process = subprocess.Popen(
        command + ([] if prefect else ["--no-prefect"]),
        cwd=cwd,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
            "PYTHONPATH": path,
            "FAULT": fault,
            **(env or {}),
        },
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    children: dict[int, psutil.Process] = {}
    commands: dict[int, str] = {}
    try:
        while process.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(process.pid).children(recursive=True):
                    children[child.pid] = child
                    commands.setdefault(child.pid, " ".join(child.cmdline()))
            time.sleep(0.2)
        log.seek(0)
        out = log.read()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    assert any("multiprocessing" in c for c in commands.values()), "no rank was started"

    def alive(child: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            return child.status() != psutil.STATUS_ZOMBIE
        return False

    # multiprocessing's resource tracker exits once the last process holding its pipe is gone.
    psutil.wait_procs([c for c in children.values() if alive(c)], timeout=5)
    left = [pid for pid, child in children.items() if alive(child)]
    assert not left, f"{[commands[p] for p in left]} outlived the run:\n{out[-4000:]}"
    return process.returncode, out.strip().splitlines()


@pytest.mark.slow
def test_a_disk_that_fills_under_a_torchrun_rank_ends_both_nodes_at_once(tmp_path, checkpoint_dir):
    """Ranks formed by torchrun (two "nodes" of one process each, on loopback), the disk full
    under rank 1 only: the driver's node ends in the fault's one line (74), and the failed
    rank's node says it in one line of its own and fails too. It exited 0 before, as a rank that
    merely left the group, and its torchrun agent could then wait out the five-minute exit
    barrier (312 s in one probe). What torchrun's agents print after their worker (failure
    summaries, c10d warnings) is the launcher's own."""
    from longstraw.distributed.launch import free_port

    root = _two_rank_run_with_a_disk_full_hook(tmp_path, checkpoint_dir("llama"))
    path = os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        "PYTHONPATH": path,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    port = free_port()
    torchrun = [
        str(Path(sys.executable).with_name("torchrun")),
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=longstraw-fault",
        "--max-restarts=0",
        "-m",
        "longstraw.cli",
        "train",
        "--config",
        "run.yaml",
        "--no-prefect",
    ]
    started = time.monotonic()
    nodes = [
        subprocess.Popen(
            torchrun,
            cwd=tmp_path,
            # Each node's environment: the fault is on rank 1's.
            env={**env, "FAULT": "full-on-rank:1" if node == 1 else "none:"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
                node.wait()
    took = time.monotonic() - started
    target = f"writing {root}/runs/faulty/checkpoints/v000002/optimizer-rank1-of-2.safetensors"
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode != 0, output[-4000:]
    driver_lines = [line for line in outputs[0].splitlines() if line.startswith("error: ")]
    assert len(driver_lines) == 1, outputs[0][-4000:]
    assert f"no space left on the volume of {root} " in driver_lines[0]
    assert target in driver_lines[0] and "--resume" in driver_lines[0]
    rank_lines = [line for line in outputs[1].splitlines() if line.startswith("error: ")]
    assert len(rank_lines) == 1, outputs[1][-4000:]
    assert rank_lines[0].startswith("error: rank 1: no space left") and target in rank_lines[0]
    assert took < 120, f"{took:.0f} s: a node waited out torchrun's exit barrier"
    run = root / "runs" / "faulty"
    assert not (run / "RUN.lock").exists()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["v000001"]
