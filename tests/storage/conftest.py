"""Fixtures: a real S3-compatible server on loopback (moto's server, which enforces If-None-Match
exclusive create) for the whole session, and a fresh storage root per test, local or s3."""

from __future__ import annotations

import logging
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # helpers.py, shared with the child-process script

from helpers import BUCKET


@pytest.fixture(scope="session")
def s3_server():
    """(endpoint url) of a ThreadedMotoServer on 127.0.0.1 with BUCKET created; stopped at the end."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3_server


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root_uri(request, tmp_path):
    """A fresh, empty storage root: a temp dir, or a fresh prefix in the loopback bucket."""
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3_env")
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"
