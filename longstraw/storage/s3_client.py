"""The S3 client LongStraw's storage uses: bounded waits, retries with backoff, and a warning
line for every retry, so a frozen or dead endpoint is never a silent stall.

A request that gets no answer within `storage.s3_read_timeout_s` (no connection within
`s3_connect_timeout_s`) is retried by botocore's "standard" retry mode — exponential backoff with
jitter, at most 20 s between attempts — up to `s3_max_attempts` attempts, and each retry is
logged as a warning naming the endpoint, the request and the wait. s3fs's own retry loop is
turned off (one pass): it would repeat botocore's whole sequence up to five times more, and the
bound on a stall would be five times what the settings say. After the last attempt the error
reaches the run, which stops with one line (`longstraw.training.storage_faults`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from urllib.parse import parse_qs, urlsplit

from s3fs import S3FileSystem

logger = logging.getLogger("longstraw.storage.s3")

_warned_at: dict[str, float] = {}
_warned_lock = threading.Lock()


def client_config(connect_timeout_s: float, read_timeout_s: float, max_attempts: int) -> dict:
    """s3fs `config_kwargs` (botocore Config) for these bounds."""
    return {
        "connect_timeout": connect_timeout_s,
        "read_timeout": read_timeout_s,
        # botocore's `max_attempts` counts retries; `total_max_attempts` the first attempt too.
        "retries": {"mode": "standard", "total_max_attempts": max_attempts},
    }


class WatchedS3FileSystem(S3FileSystem):
    """s3fs whose clients log each retry (see the module docstring); one attempt per s3fs call."""

    retries = 1  # s3fs's loop; botocore retries inside each call

    async def set_session(self, refresh=False, kwargs=None):
        client = await super().set_session(refresh=refresh, kwargs=kwargs or {})
        config = client.meta.config
        client.meta.events.register(
            "needs-retry.s3",
            RetryWarning(
                self.endpoint_url or client.meta.endpoint_url,
                float(config.read_timeout),
                int((config.retries or {}).get("total_max_attempts", 1)),
            ),
            unique_id="longstraw-retry-warning",
        )
        client.meta.events.register_last(
            "before-call.s3", _no_expect_continue, unique_id="longstraw-no-expect-continue"
        )
        if self.asynchronous:
            # s3fs closes a synchronous instance's connections at exit, an asynchronous one's
            # (zarr's) never: aiohttp then says "Unclosed client session" after the run's last
            # line. Closed the way s3fs closes its own when its loop is gone.
            weakref.finalize(self, _close_connections, client)
        return client


def _close_connections(client) -> None:
    http = getattr(getattr(client, "_endpoint", None), "http_session", None)
    for session in list((getattr(http, "_sessions", None) or {}).values()):
        connector = session.connector
        if connector is not None and not connector.closed:
            with contextlib.suppress(Exception):
                connector._close()


def _no_expect_continue(params=None, **kwargs) -> None:
    """Drop botocore's `Expect: 100-continue` (PutObject, UploadPart): aiohttp waits for the
    "100 Continue" with no timeout at all, so an endpoint that accepts the connection and then
    never answers would stall the upload forever, read timeout or not. Without it the body goes
    at once and the read timeout bounds the wait for the answer (a refused upload costs its
    body's bytes on the wire, nothing more)."""
    if params is not None:
        params.get("headers", {}).pop("Expect", None)


class RetryWarning:
    """botocore `needs-retry` handler: a warning when a request failed in a way that the retry
    mode retries (no answer, no connection, a 5xx) and attempts are left. Returns None, so the
    retry decision stays botocore's."""

    def __init__(self, endpoint: str, read_timeout_s: float, max_attempts: int):
        self.endpoint = endpoint
        self.read_timeout_s = read_timeout_s
        self.max_attempts = max_attempts

    def __call__(
        self, attempts=None, caught_exception=None, response=None, operation=None, **kwargs
    ):
        if attempts is None or attempts >= self.max_attempts:
            return None  # the last attempt: the error itself says what happened
        what = failure_description(caught_exception, response, self.read_timeout_s)
        if what is None:
            return None
        now = time.monotonic()
        with _warned_lock:
            # Parallel chunk transfers to one endpoint fail together: one line per wait.
            if now - _warned_at.get(self.endpoint, -1e9) < self.read_timeout_s:
                return None
            _warned_at[self.endpoint] = now
        request = kwargs.get("request_dict") or {}
        target = request_target(request.get("url", "")) or "?"
        logger.warning(
            "warning: S3 endpoint %s %s (%s %s); retrying with backoff, attempt %d of %d "
            "(storage.s3_read_timeout_s, storage.s3_max_attempts)",
            self.endpoint,
            what,
            getattr(operation, "name", "request"),
            target,
            attempts + 1,
            self.max_attempts,
        )
        return None


def request_target(url: str) -> str:
    """The object a request is about: its URL's path, and a listing's prefix (`/bucket/a/b`
    for `/bucket?list-type=2&prefix=a/b`). Nothing else of the query: it may hold an upload
    id, never worth a log line."""
    parts = urlsplit(url)
    prefixes = parse_qs(parts.query).get("prefix")
    if prefixes and prefixes[0]:
        return f"{parts.path.rstrip('/')}/{prefixes[0].lstrip('/')}"
    return parts.path


def failure_description(caught_exception, response, read_timeout_s: float) -> str | None:
    """'did not answer within 30 s (ReadTimeoutError)' and the like; None for a failure that is
    not the endpoint's (or that the retry mode does not retry)."""
    from botocore.exceptions import (
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    if caught_exception is not None:
        name = type(caught_exception).__name__
        if isinstance(caught_exception, ReadTimeoutError):
            return f"did not answer within {read_timeout_s:g} s ({name})"
        if isinstance(caught_exception, ConnectTimeoutError):
            return f"did not accept a connection in time ({name})"
        if isinstance(caught_exception, EndpointConnectionError):
            return f"cannot be reached ({name})"
        if isinstance(caught_exception, ConnectionClosedError):
            return f"closed the connection ({name})"
        return None
    status = getattr(response[0], "status_code", None) if response else None
    if status is not None and status >= 500:
        return f"answered HTTP {status}"
    return None
