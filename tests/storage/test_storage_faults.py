"""Storage faults met mid-run end `longstraw train` in one `error:` line that names the path and
the fix, exit status 74, no traceback (that is `--debug`'s), the run's lease released, and the run
resumable: a disk that fills (a small tmpfs, filled by a reward function at step 1), a root that
turns read-only (the tmpfs remounted), an S3 endpoint that goes away or stops answering (a proxy
in front of the loopback S3 server), a prompt-state chunk whose bytes were flipped.

The mount tests need root with CAP_SYS_ADMIN (a VM or a privileged container) and skip elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from conftest import BUCKET
from helpers import assert_bitwise_equal

from longstraw.errors import UserError
from longstraw.schemas.run import RunConfig
from longstraw.schemas.storage import StorageConfig
from longstraw.storage.errors import ChunkChecksumError
from longstraw.training.run_lease import live_lease, run_lease
from longstraw.training.storage_faults import EX_IOERR, StorageFault, storage_fault

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 10  # the run header (a long root wraps it), progress bars, a warning or two, the error

# A reward that does the fault's damage on its third call (the first sample of step 1), then
# scores like any other: the run is in the middle of a step with one checkpoint committed. Its
# score depends on the response, so the steps' gradients are not zero and a resumed run's final
# weights say whether it redid the step as the uninterrupted run did.
HOOK = """
import os, subprocess

_calls = 0


def fault(prompt, response, metadata):
    global _calls
    _calls += 1
    if _calls == 3:
        kind, _, target = os.environ.get("FAULT", "none:").partition(":")
        if kind == "fill":  # leave 64 KiB on the volume
            free = shutil_free(os.path.dirname(target))
            with open(target, "wb") as filler:
                filler.write(bytes(max(0, free - 65536)))
        elif kind == "read-only":
            subprocess.run(["mount", "-o", "remount,ro", target], check=True)
        elif kind == "proxy":  # the S3 proxy's mode: down or frozen
            mode, _, path = target.partition("@")
            with open(path, "w") as control:
                control.write(mode)
            __import__("time").sleep(0.3)  # the proxy looks every 50 ms
    return sum(response.encode()) % 7 / 6


def shutil_free(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
"""


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


def _write_run(directory: Path, checkpoint: Path, storage: dict | None, **extra) -> Path:
    config = {
        "run_id": "faulty",
        "model": {"checkpoint": str(checkpoint)},
        "train": {"num_steps": 2, "groups_per_step": 1},
        "grpo": {"num_generations": 2, "max_completion_length": 2},
        "data": {"type": "haystack", "rewards": ["fault_hook:fault"]},
    } | extra
    if storage is not None:
        config["storage"] = {"persist_mode": "synchronous", **storage}
    (directory / "fault_hook.py").write_text(HOOK)
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(
    cwd: Path, *args: str, fault: str = "none:", prefect: bool = False, env: dict | None = None
):
    """(exit status, output lines) of `longstraw train --config run.yaml ARGS` in `cwd`."""
    path = os.pathsep.join([str(cwd), str(REPO), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "longstraw.cli", "train", "--config", "run.yaml", *args]
    done = subprocess.run(
        command + ([] if prefect else ["--no-prefect"]),
        cwd=cwd,
        # No Prefect settings of this test process (a harness's): the run's own, or its defaults.
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
            "PYTHONPATH": path,
            "FAULT": fault,
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, lines


def _assert_one_error_line(rc: int, lines: list[str], *needles: str) -> str:
    text = "\n".join(lines)
    assert rc == EX_IOERR, text[-4000:]
    assert lines[-1].startswith("error: "), text[-4000:]
    assert len(lines) <= MAX_LINES, text[-4000:]
    assert "Traceback" not in text and "─────" not in text, text[-4000:]
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors files (weights, each rank's optimizer rows)."""
    from safetensors.torch import load_file

    return {
        f"{file.name}:{name}": tensor
        for file in sorted(checkpoint.glob("*.safetensors"))
        for name, tensor in load_file(file).items()
    }


@pytest.fixture(scope="module")
def one_process_final(tmp_path_factory, checkpoint_dir) -> dict[int, dict[str, torch.Tensor]]:
    """The tensors of checkpoints v000002 and v000003 of the one-process run uninterrupted:
    what the one-process runs below must end on after their `--resume`. Three steps; the
    learning rate does not depend on the number of steps, so v000002 is also where a two-step
    run ends."""
    directory = tmp_path_factory.mktemp("one-process-uninterrupted")
    root = directory / "root"
    _write_run(
        directory,
        checkpoint_dir("llama"),
        {"root_uri": str(root)},
        train={"num_steps": 3, "groups_per_step": 1},
    )
    rc, lines = _train(directory)
    assert rc == 0, "\n".join(lines)[-4000:]
    checkpoints = root / "runs" / "faulty" / "checkpoints"
    return {v: _tensors(checkpoints / f"v{v:06d}") for v in (2, 3)}


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
    Prefect's task retries leave alone (`orchestration.policies.retry_on_transient`)."""
    from botocore.exceptions import ClientError, EndpointConnectionError
    from s3fs.errors import translate_boto_error

    from longstraw.orchestration.policies import retry_on_transient

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


def test_a_disk_that_fills_mid_run_ends_in_one_line_and_resumes(
    tmp_path, tmpfs, checkpoint_dir, one_process_final
):
    disk = tmpfs("16m")
    root = disk / "root"
    _write_run(tmp_path, checkpoint_dir("llama"), {"root_uri": str(root)})
    rc, lines = _train(tmp_path, fault=f"fill:{disk / 'filler'}")
    line = _assert_one_error_line(
        rc, lines, f"no space left on the volume of {root}", "free at least", "MiB there"
    )
    assert "then continue it with: longstraw train --config run.yaml --resume" in line
    run = root / "runs" / "faulty"
    assert not (run / "RUN.lock").exists()
    assert not list(run.rglob("*.tmp-*")), "a half-written file was left behind"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["v000001"]

    (disk / "filler").unlink()
    rc, lines = _train(tmp_path, "--resume")
    assert rc == 0, "\n".join(lines)[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["v000001", "v000002"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert_bitwise_equal(_tensors(run / "checkpoints" / "v000002"), one_process_final[2])


@pytest.mark.prefect
@pytest.mark.slow
def test_a_full_disk_under_the_embedded_prefect_server_is_said_once(
    tmpfs, checkpoint_dir, fresh_prefect_home
):
    # The embedded default: run storage and Prefect's database on one volume (./.longstraw).
    disk = tmpfs("24m")
    home = fresh_prefect_home(disk / ".longstraw" / "prefect")
    _write_run(disk, checkpoint_dir("llama"), {})
    rc, lines = _train(
        disk,
        fault=f"fill:{disk / 'filler'}",
        prefect=True,
        env={"PREFECT_HOME": str(home), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"},
    )
    _assert_one_error_line(rc, lines, f"no space left on the volume of {disk / '.longstraw'}")
    assert not (disk / ".longstraw" / "runs" / "faulty" / "RUN.lock").exists()


def test_a_root_that_turns_read_only_names_its_lease(
    tmp_path, tmpfs, checkpoint_dir, one_process_final
):
    disk = tmpfs("16m")
    root = disk / "root"
    _write_run(tmp_path, checkpoint_dir("llama"), {"root_uri": str(root)})
    try:
        rc, lines = _train(tmp_path, fault=f"read-only:{disk}")
        lease = root / "runs" / "faulty" / "RUN.lock"
        _assert_one_error_line(
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
    rc, lines = _train(tmp_path, "--resume")  # remounted read-write
    assert rc == 0, "\n".join(lines)[-4000:]
    run = root / "runs" / "faulty"
    assert not list(run.rglob("*.tmp-*")), "a half-written file was left behind"
    assert_bitwise_equal(_tensors(run / "checkpoints" / "v000002"), one_process_final[2])


class _S3Proxy:
    """TCP proxy on 127.0.0.1 in front of an S3 endpoint. Its mode is the control file's text:
    forward; frozen (connections are accepted and held, nothing is answered); down (the port is
    closed and every connection dropped: connection refused)."""

    def __init__(self, upstream: str, control: Path):
        self.upstream = upstream.removeprefix("http://").split(":")
        self.control = control
        control.write_text("forward")
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.stopped = threading.Event()
        for target in (self._accept, self._watch):
            threading.Thread(target=target, daemon=True).start()

    def mode(self) -> str:
        return self.control.read_text().strip()

    def _watch(self) -> None:
        while not self.stopped.wait(0.05):
            if self.mode() == "down":
                self.close()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.sockets.append(client)
            if self.mode() != "forward":
                continue  # frozen: held open, never answered
            server = socket.create_connection((self.upstream[0], int(self.upstream[1])))
            self.sockets.append(server)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                while self.mode() == "frozen" and not self.stopped.is_set():
                    time.sleep(0.05)
                sink.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.stopped.set()
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.fixture
def s3_proxy(s3_env, tmp_path):
    proxy = _S3Proxy(s3_env, tmp_path / "proxy-mode")
    yield proxy
    proxy.close()


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
    # Three steps: the proxy changes at step 1's rollout, step 2's prefill meets it.
    _write_run(
        tmp_path, checkpoint_dir("llama"), storage, train={"num_steps": 3, "groups_per_step": 1}
    )
    started = time.monotonic()
    rc, lines = _train(tmp_path, fault=f"proxy:{mode}@{s3_proxy.control}")
    line = _assert_one_error_line(
        rc, lines, f"S3 endpoint {s3_proxy.url}", "after 2 attempts", "--resume"
    )
    assert said in line or "closed the connection" in line, line
    # The wait before giving up is bounded and said: a warning per retry, not a silent stall.
    warnings = [w for w in lines if w.startswith("warning: S3 endpoint")]
    assert warnings and "retrying with backoff, attempt 2 of 2" in warnings[0], lines
    assert time.monotonic() - started < 120
    run = tmp_path / "local" / "runs" / "faulty"
    assert not (run / "RUN.lock").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["v000001", "v000002"]
    if mode == "frozen":
        return  # the resume is one path: run it once, after the endpoint that went away
    # The endpoint back (here: the server itself, the proxy gone): the run ends where the
    # uninterrupted one does.
    config = yaml.safe_load((tmp_path / "run.yaml").read_text())
    config["storage"]["s3_endpoint_url"] = s3_env
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    rc, lines = _train(tmp_path, "--resume")
    assert rc == 0, "\n".join(lines)[-4000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    final = request.getfixturevalue("one_process_final")[3]
    assert_bitwise_equal(_tensors(run / "checkpoints" / "v000003"), final)


def test_a_corrupted_prompt_state_chunk_is_named_with_its_removal(tmp_path, checkpoint_dir):
    from longstraw.training.loop import train

    root = tmp_path / "root"
    run_yaml = _write_run(tmp_path, checkpoint_dir("llama"), {"root_uri": str(root)})
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

    rc, lines = _train(tmp_path, "--resume", "--steps", "1")
    _assert_one_error_line(
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
    _write_run(
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
    rc, lines = _train(directory)
    assert rc == 0, "\n".join(lines)[-4000:]
    return _tensors(root / "runs" / "faulty" / "checkpoints" / "v000002")


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
    line = _assert_one_error_line(
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
    rc, lines = _train(tmp_path, "--resume", prefect=prefect, env=env)
    assert rc == 0, "\n".join(lines)[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["v000001", "v000002"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert_bitwise_equal(
        _tensors(run / "checkpoints" / "v000002"), request.getfixturevalue("two_rank_final")
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
    proxy = _S3Proxy(s3_env, tmp_path / "proxy-mode")
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
    _assert_one_error_line(
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
    _assert_one_error_line(
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

    rc, lines = _train(tmp_path, "--resume")
    assert rc == 0, "\n".join(lines)[-4000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert_bitwise_equal(_tensors(run / "checkpoints" / "v000002"), two_rank_final)


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
