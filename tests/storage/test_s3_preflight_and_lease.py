"""The S3 side of the run checks, against the loopback S3 server (moto) of this package's conftest:
the preflight's writability probe (put, then delete, one object) and the run lease of an S3 run
(its `RUN.lock` lives under `storage.local_dir`, beside the checkpoints)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
from helpers import BUCKET

from longstraw.errors import UserError
from longstraw.schemas.run import RunConfig
from longstraw.training.preflight import check_storage_writable
from longstraw.training.run_lease import RunLeaseHeld, lease_path, run_lease

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys
from longstraw.schemas.run import RunConfig
from longstraw.training.run_lease import run_lease
config = RunConfig.model_validate(
    {"run_id": "s3-leased", "storage": {"root_uri": sys.argv[1], "local_dir": sys.argv[2]}}
)
with run_lease(config):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


def _config(root_uri: str, local_dir: Path, run_id: str = "s3-leased") -> RunConfig:
    return RunConfig.model_validate(
        {"run_id": run_id, "storage": {"root_uri": root_uri, "local_dir": str(local_dir)}}
    )


def _objects(endpoint: str, prefix: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for o in listed.get("Contents", [])]


def test_preflight_probe_writes_to_the_bucket_and_leaves_nothing_behind(s3_env, tmp_path):
    prefix = uuid.uuid4().hex
    config = _config(f"s3://{BUCKET}/{prefix}", tmp_path / "local")
    # An object already there: the probe must not disturb it, and must remove its own.
    boto3.client("s3", endpoint_url=s3_env, region_name="us-east-1").put_object(
        Bucket=BUCKET, Key=f"{prefix}/kept", Body=b"x"
    )
    check_storage_writable(config)
    assert _objects(s3_env, prefix) == [f"{prefix}/kept"]
    assert (tmp_path / "local").is_dir(), "checkpoints' local directory was probed too"


def test_preflight_names_the_s3_settings_when_the_bucket_is_missing(s3_env, tmp_path):
    config = _config(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p", tmp_path / "local")
    with pytest.raises(UserError, match="is not writable") as error:
        check_storage_writable(config)
    message = error.value.one_line()
    assert "no-such-bucket-" in message and "AWS_ACCESS_KEY_ID" in message, message
    assert "AWS_ENDPOINT_URL_S3" in message and " — " in message, message


def test_preflight_refuses_an_unreachable_s3_endpoint(s3_env, tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    config = _config(f"s3://{BUCKET}/{uuid.uuid4().hex}", tmp_path / "local")
    started = time.monotonic()
    with pytest.raises(UserError, match="is not writable"):
        check_storage_writable(config)
    assert time.monotonic() - started < 60


@pytest.mark.processes  # the second writer is a process of its own
def test_s3_runs_lease_lives_beside_its_checkpoints_and_refuses_a_second_writer(s3_env, tmp_path):
    root_uri = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    config = _config(root_uri, local)
    assert lease_path(config) == local.resolve() / "runs" / "s3-leased" / "RUN.lock"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, root_uri, str(local)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLeaseHeld) as refused, run_lease(config):
            pytest.fail("a second writer of the S3 run got the lease")
        assert f"pid {holder.pid}" in refused.value.one_line()
        # Another run id on the same bucket prefix has its own lease.
        with run_lease(_config(root_uri, local, run_id="s3-other")) as path:
            assert path.is_file()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.returncode == 0
    assert not lease_path(config).exists(), "the holder released its lease on exit"
    assert _objects(s3_env, root_uri.split("/", 3)[3]) == [], "the lease touches no S3 object"
