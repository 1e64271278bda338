"""Storage faults met mid-run end `longstraw train` in one `error:` line that names the path and
the fix, exit status 74, no traceback (that is `--debug`'s), the run's lease released, and the run
resumable to the uninterrupted run's final checkpoint: a disk that fills (a small tmpfs, filled by
a reward function at step 1), a root that turns read-only (the tmpfs remounted), an S3 endpoint
that goes away or stops answering (a proxy in front of the loopback S3 server), a prompt-state
chunk whose bytes were flipped. One process; the same faults under one of several ranks:
test_rank_storage_faults.py.

The mount tests need root with CAP_SYS_ADMIN (a VM or a privileged container) and skip elsewhere.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from fault_runs import (
    S3Proxy,
    assert_one_error_line,
    checkpoint_tensors,
    run_train,
    write_run,
)
from helpers import BUCKET, assert_bitwise_equal

from longstraw.errors import UserError
from longstraw.schemas.run import RunConfig
from longstraw.schemas.storage import StorageConfig
from longstraw.storage.errors import ChunkChecksumError
from longstraw.training.run_lease import live_lease, run_lease
from longstraw.training.storage_faults import StorageFault, storage_fault


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(size)` -> a fresh tmpfs mounted under tmp_path (unmounted after the test)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
        )
        if done.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
        mounted.append(path)
        return path

    if not _can_mount():
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def one_process_final(tmp_path_factory, checkpoint_dir) -> dict[int, dict[str, torch.Tensor]]:
    """The tensors of checkpoints v000002 and v000003 of the one-process run uninterrupted:
    what the one-process runs below must end on after their `--resume`. Three steps; the
    learning rate does not depend on the number of steps, so v000002 is also where a two-step
    run ends."""
    directory = tmp_path_factory.mktemp("one-process-uninterrupted")
    root = directory / "root"
    write_run(
        directory,
        checkpoint_dir("llama"),
        {"root_uri": str(root)},
        train={"num_steps": 3, "groups_per_step": 1},
    )
    rc, lines = run_train(directory)
    assert rc == 0, "\n".join(lines)[-4000:]
    checkpoints = root / "runs" / "faulty" / "checkpoints"
    return {v: checkpoint_tensors(checkpoints / f"v{v:06d}") for v in (2, 3)}


# --- the mapping, without a run ---------------------------------------------------------------


def _config(tmp_path: Path, **storage) -> RunConfig:
    return RunConfig.model_validate(
        {"run_id": "r", "storage": {"root_uri": str(tmp_path / "root"), **storage}}
    )


def test_each_fault_is_named_with_its_path_and_fix(tmp_path):
    config = _config(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    file = root / "runs" / "r" / "checkpoints" / "v000002.tmp-0a1b2c3d"

    full = storage_fault(OSError(errno.ENOSPC, "No space left on device", str(file)), config)
    assert full.kind == "full" and f"no space left on the volume of {root}" in str(full)
    # The checkpoint's temporary name is not what the user looks for (it was removed).
    assert "checkpoints/v000002 " in str(full) and ".tmp-" not in str(full)
    assert "free at least" in str(full) and "one step writes about" in str(full)
    assert "checkpoint" in str(full) and "--resume" in str(full)

    read_only = storage_fault(OSError(errno.EROFS, "Read-only file system", str(file)), config)
    assert read_only.kind == "read-only" and "remount it read-write" in str(read_only)

    denied = storage_fault(PermissionError(errno.EACCES, "Permission denied", str(file)), config)
    assert denied.kind == "permission" and f"write access to {root}" in str(denied)

    # Wrapped as a library says it, with the errno in its text only (safetensors, Rust).
    wrapped = RuntimeError("Error while serializing: I/O error: No space left (os error 28)")
    assert storage_fault(wrapped, config, doing="stage write_checkpoint").kind == "full"

    chunk = f"file://{root}/runs/r/policy-v0/prompts/abc/attempt-1234/state.zarr/x/c/0/0"
    damaged = storage_fault(ChunkChecksumError("x", (0, 0), chunk, "sha256 a != b"), config)
    state = f"{root}/runs/r/policy-v0/prompts/abc"
    assert damaged.kind == "damaged-state" and f"prompt state file://{state} is damaged" in str(
        damaged
    )
    assert f"rm -r {state})" in str(damaged) and "longstraw state verify" in str(damaged)

    for unrelated in (ValueError("bad"), FileNotFoundError(errno.ENOENT, "gone", str(file))):
        assert storage_fault(unrelated, config) is None
    # Found behind the wrappers it travels in, and the first one raised is the one said.
    try:
        try:
            raise full
        except StorageFault as inner:
            raise RuntimeError("a Prefect wrapper") from inner
    except RuntimeError as outer:
        assert storage_fault(outer, config) is full

    restored = pickle.loads(pickle.dumps(full))  # Prefect keeps a failed task's exception
    assert isinstance(restored, UserError) and str(restored) == str(full)


def test_s3_errors_name_the_endpoint_the_object_and_the_setting(tmp_path):
    from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

    config = _config(
        tmp_path,
        root_uri=f"s3://{BUCKET}/p",
        local_dir=str(tmp_path / "local"),
        s3_endpoint_url="http://127.0.0.1:9",
        s3_read_timeout_s=7,
        s3_max_attempts=3,
    )
    url = "http://127.0.0.1:9/bucket/a/COMMITTED.json?uploadId=secret"
    refused = storage_fault(EndpointConnectionError(endpoint_url=url), config)
    assert refused.kind == "s3" and "S3 endpoint http://127.0.0.1:9 cannot be reached" in str(
        refused
    )
    assert "at s3://bucket/a/COMMITTED.json, after 3 attempts" in str(refused)
    assert "secret" not in str(refused) and "storage.s3_endpoint_url" in str(refused)
    frozen = storage_fault(ReadTimeoutError(endpoint_url=url), config)
    assert "did not answer within 7 s" in str(frozen) and "s3_read_timeout_s" in str(frozen)


def test_s3_error_answers_are_the_endpoints_or_the_credentials_fault_not_the_volumes(tmp_path):
    """s3fs turns an S3 error answer into an OSError (503 SlowDown -> EBUSY, 500 -> EREMOTEIO,
    an unknown code -> EIO, AccessDenied -> PermissionError without an errno). Said as the
    endpoint's or the credentials' fault, never as a local device's, and a StorageFault, which
    Prefect's task retries leave alone (`tasks.policies.retry_on_transient`)."""
    from botocore.exceptions import ClientError, EndpointConnectionError
    from s3fs.errors import translate_boto_error

    from longstraw.tasks.policies import retry_on_transient

    root = f"s3://{BUCKET}/p"
    # AWS itself: no endpoint setting to name.
    config = _config(
        tmp_path,
        root_uri=root,
        local_dir=str(tmp_path / "local"),
        s3_endpoint_url=None,
        s3_max_attempts=3,
    )

    def answered(code: str, status: int, operation: str = "PutObject") -> BaseException:
        error = ClientError(
            {
                "Error": {"Code": code, "Message": "m"},
                "ResponseMetadata": {"HTTPStatusCode": status},
            },
            operation,
        )
        return translate_boto_error(error)  # what reaches the stage, the ClientError its cause

    for code, status in (
        ("SlowDown", 503),
        ("InternalError", 500),
        ("WeirdFailure", 502),
        ("RequestTimeout", 400),
    ):
        fault = storage_fault(answered(code, status), config)
        assert fault.kind == "s3", (code, fault)
        assert f"the S3 endpoint answered HTTP {status} {code} to PutObject at {root}" in str(fault)
        assert "after 3 attempts" in str(fault) and "dmesg" not in str(fault)
    for code, status in (("ExpiredToken", 400), ("AccessDenied", 403)):
        fault = storage_fault(answered(code, status, "GetObject"), config)
        assert fault.kind == "s3" and "refused the credentials" in str(fault), fault
        assert "attempts" not in str(fault)  # botocore does not retry a refusal
        assert "AWS_SESSION_TOKEN" in str(fault) and f"may write under {root}" in str(fault)
    assert storage_fault(answered("NoSuchKey", 404), config) is None  # not the storage's fault

    # A listing names its prefix (and nothing else of the query).
    url = f"http://127.0.0.1:9/{BUCKET}?list-type=2&prefix=p%2Fruns%2Fr&continuation-token=t"
    fault = storage_fault(EndpointConnectionError(endpoint_url=url), config)
    assert f"at s3://{BUCKET}/p/runs/r, after 3 attempts" in str(fault), fault
    # A rank's own route (or the environment's endpoint) is the endpoint named, and an AWS
    # virtual-hosted URL still names its bucket.
    url = f"https://{BUCKET}.s3.eu-west-1.amazonaws.com/p/a/COMMITTED.json"
    fault = storage_fault(EndpointConnectionError(endpoint_url=url), config)
    assert str(fault).startswith(
        f"S3 endpoint https://{BUCKET}.s3.eu-west-1.amazonaws.com cannot be reached "
        f"(EndpointConnectionError) at s3://{BUCKET}/p/a/COMMITTED.json, after 3 attempts"
    ), fault

    # Prefect retries no storage fault: botocore's attempts (storage.s3_max_attempts, with
    # backoff) are the one bound on an S3 stall, and a task retry would redo the stage's compute.
    class Failed:
        def result(self):
            raise fault

    assert retry_on_transient(None, None, Failed()) is False


def test_a_lease_that_cannot_be_removed_is_said_with_how_to_remove_it(tmp_path, monkeypatch):
    import longstraw.training.run_lease as leases

    config = _config(tmp_path)

    def read_only(path, content):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    fault = StorageFault("disk trouble", "fix it", path=str(tmp_path), kind="read-only")
    with pytest.raises(StorageFault) as raised, run_lease(config) as path:
        monkeypatch.setattr(leases, "remove_if_unchanged", read_only)
        raise fault
    (note,) = raised.value.__notes__
    assert f"its lease {path} could not be removed (Read-only file system)" in note
    assert f"rm {path}" in note and "takes it over at once" in note
    # Released in this process (a later run_lease here does not re-enter it); the file names a
    # process that is gone once this one exits, and the next run takes it over (the CLI test).
    assert path.exists() and path not in leases._held


# --- through `longstraw train` ----------------------------------------------------------------


@pytest.mark.processes
def test_a_disk_that_fills_mid_run_ends_in_one_line_and_resumes(
    tmp_path, tmpfs, checkpoint_dir, one_process_final
):
    disk = tmpfs("16m")
    root = disk / "root"
    write_run(tmp_path, checkpoint_dir("llama"), {"root_uri": str(root)})
    rc, lines = run_train(tmp_path, fault=f"fill:{disk / 'filler'}")
    line = assert_one_error_line(
        rc, lines, f"no space left on the volume of {root}", "free at least", "MiB there"
    )
    assert "then continue it with: longstraw train --config run.yaml --resume" in line
    run = root / "runs" / "faulty"
    assert not (run / "RUN.lock").exists()
    assert not list(run.rglob("*.tmp-*")), "a half-written file was left behind"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["v000001"]

    (disk / "filler").unlink()
    rc, lines = run_train(tmp_path, "--resume")
    assert rc == 0, "\n".join(lines)[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["v000001", "v000002"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert_bitwise_equal(checkpoint_tensors(run / "checkpoints" / "v000002"), one_process_final[2])


@pytest.mark.processes
@pytest.mark.prefect
@pytest.mark.slow
def test_a_full_disk_under_the_embedded_prefect_server_is_said_once(
    tmpfs, checkpoint_dir, fresh_prefect_home
):
    # The embedded default: run storage and Prefect's database on one volume (./.longstraw).
    disk = tmpfs("24m")
    home = fresh_prefect_home(disk / ".longstraw" / "prefect")
    write_run(disk, checkpoint_dir("llama"), {})
    rc, lines = run_train(
        disk,
        fault=f"fill:{disk / 'filler'}",
        prefect=True,
        env={"PREFECT_HOME": str(home), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"},
    )
    assert_one_error_line(rc, lines, f"no space left on the volume of {disk / '.longstraw'}")
    assert not (disk / ".longstraw" / "runs" / "faulty" / "RUN.lock").exists()


@pytest.mark.processes
def test_a_root_that_turns_read_only_names_its_lease(
    tmp_path, tmpfs, checkpoint_dir, one_process_final
):
    disk = tmpfs("16m")
    root = disk / "root"
    write_run(tmp_path, checkpoint_dir("llama"), {"root_uri": str(root)})
    try:
        rc, lines = run_train(tmp_path, fault=f"read-only:{disk}")
        lease = root / "runs" / "faulty" / "RUN.lock"
        assert_one_error_line(
            rc,
            lines,
            f"{root} is on a read-only file system (EROFS)",
            "remount it read-write",
            f"its lease {lease} could not be removed",
            f"rm {lease}",
        )
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    assert live_lease(lease) is None and not lease.exists(), "the dead holder's lease stays"
    rc, lines = run_train(tmp_path, "--resume")  # remounted read-write
    assert rc == 0, "\n".join(lines)[-4000:]
    run = root / "runs" / "faulty"
    assert not list(run.rglob("*.tmp-*")), "a half-written file was left behind"
    assert_bitwise_equal(checkpoint_tensors(run / "checkpoints" / "v000002"), one_process_final[2])


@pytest.fixture
def s3_proxy(s3_env, tmp_path):
    proxy = S3Proxy(s3_env, tmp_path / "proxy-mode")
    yield proxy
    proxy.close()


@pytest.mark.processes
@pytest.mark.s3
@pytest.mark.parametrize(
    ("mode", "said"),
    [("down", "cannot be reached"), ("frozen", "did not answer within 1 s (ReadTimeoutError)")],
)
def test_an_s3_endpoint_that_goes_away_or_freezes_mid_run(
    mode, said, tmp_path, s3_env, s3_proxy, checkpoint_dir, request
):
    storage = {
        "root_uri": f"s3://{BUCKET}/{uuid.uuid4().hex}",
        "local_dir": str(tmp_path / "local"),
        "s3_endpoint_url": s3_proxy.url,
        "s3_read_timeout_s": 1,
        "s3_connect_timeout_s": 1,
        "s3_max_attempts": 2,
    }
    # Three steps: the proxy changes at step 1's rollout, and step 1's exact backward meets it
    # (it looks on the run's storage for a sweep checkpoint to continue from).
    write_run(
        tmp_path, checkpoint_dir("llama"), storage, train={"num_steps": 3, "groups_per_step": 1}
    )
    started = time.monotonic()
    rc, lines = run_train(tmp_path, fault=f"proxy:{mode}@{s3_proxy.control}")
    line = assert_one_error_line(
        rc, lines, f"S3 endpoint {s3_proxy.url}", "after 2 attempts", "--resume"
    )
    assert said in line or "closed the connection" in line, line
    # The wait before giving up is bounded and said: a warning per retry, not a silent stall.
    warnings = [w for w in lines if w.startswith("warning: S3 endpoint")]
    assert warnings and "retrying with backoff, attempt 2 of 2" in warnings[0], lines
    assert time.monotonic() - started < 120
    run = tmp_path / "local" / "runs" / "faulty"
    assert not (run / "RUN.lock").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["v000001"]
    if mode == "frozen":
        return  # the resume is one path: run it once, after the endpoint that went away
    # The endpoint back (here: the server itself, the proxy gone): the run ends where the
    # uninterrupted one does.
    config = yaml.safe_load((tmp_path / "run.yaml").read_text())
    config["storage"]["s3_endpoint_url"] = s3_env
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    rc, lines = run_train(tmp_path, "--resume")
    assert rc == 0, "\n".join(lines)[-4000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    final = request.getfixturevalue("one_process_final")[3]
    assert_bitwise_equal(checkpoint_tensors(run / "checkpoints" / "v000003"), final)


@pytest.mark.processes
def test_a_corrupted_prompt_state_chunk_is_named_with_its_removal(tmp_path, checkpoint_dir):
    from longstraw.training.loop import train

    root = tmp_path / "root"
    run_yaml = write_run(tmp_path, checkpoint_dir("llama"), {"root_uri": str(root)})
    config = RunConfig.model_validate(
        {**yaml.safe_load(run_yaml.read_text()), "data": {"type": "haystack"}}
    )
    config = config.model_copy(update={"train": config.train.model_copy(update={"num_steps": 1})})
    train(config)  # step 0 commits the prompt state of policy version 0
    run = root / "runs" / "faulty"
    # No checkpoint: the resume starts from the initial weights and reads that state back.
    shutil.rmtree(run / "checkpoints")
    (state,) = (run / "policy-v0" / "prompts").iterdir()
    chunk = next(p for p in sorted(state.rglob("*")) if p.is_file() and "/c/" in str(p))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))

    rc, lines = run_train(tmp_path, "--resume", "--steps", "1")
    assert_one_error_line(
        rc,
        lines,
        f"prompt state {state} is damaged",
        "!= manifest",
        f"rm -r {state})",
        "longstraw state verify",
    )
    assert not (run / "RUN.lock").exists()


def test_a_frozen_endpoint_is_a_bounded_wait_with_a_warning(s3_env, caplog):
    """A server that accepts connections and never answers: each request gives up after the
    read timeout, is retried with backoff (a warning line), and fails after the last attempt."""
    from botocore.exceptions import ReadTimeoutError

    from longstraw.storage.paths import filesystem

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(
        target=lambda: [held.append(listener.accept()[0]) for _ in iter(int, 1)], daemon=True
    ).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    config = StorageConfig(
        root_uri=f"s3://{BUCKET}/frozen",
        s3_endpoint_url=url,
        s3_read_timeout_s=0.5,
        s3_max_attempts=2,
    )
    fs, path = filesystem(f"s3://{BUCKET}/frozen/obj", config)
    try:
        # A put: botocore asks `Expect: 100-continue` there, which aiohttp awaits forever.
        started = time.monotonic()
        with (
            caplog.at_level(logging.WARNING, "longstraw.storage.s3"),
            pytest.raises(ReadTimeoutError),
        ):
            fs.pipe_file(path, b"x")
        assert time.monotonic() - started < 15
        (warning,) = [r.getMessage() for r in caplog.records]
        assert f"S3 endpoint {url} did not answer within 0.5 s (ReadTimeoutError)" in warning
        assert "(PutObject /longstraw-tests/frozen/obj)" in warning
        assert "retrying with backoff, attempt 2 of 2" in warning
    finally:
        listener.close()
        for sock in held:
            sock.close()
