"""Storage faults met mid-run, said as one line that names the path and what to do.

A disk that fills, a volume that turns read-only, write permission taken away, an S3 endpoint
that refuses connections, stops answering or answers 5xx, S3 credentials refused mid-run, a
prompt-state chunk whose bytes differ from its manifest: each reaches the run as an OSError, a
botocore error (s3fs's OSError for an error answer) or a StateIntegrityError, often
wrapped (safetensors, zarr, Prefect) and behind hundreds of lines of traceback. `storage_fault`
finds it in an exception's chain and turns it into a `StorageFault` ("<what> — <fix>"). Every
stage raises that instead (`storage_faults`), so Prefect's console shows none of it (it is a
UserError, `flows.console`), and `longstraw train` prints it as its last line, exit status
74 (EX_IOERR), the traceback only with `--debug`.

Nothing half-written is read afterwards: checkpoints commit by a rename, prompt states by a marker
written last, metrics and the plot by a rename; a failed checkpoint write removes its temporary
directory. So each fault is followed by `--resume` once its cause is fixed. Prefect's task
retries leave a StorageFault alone (`tasks.policies.retry_on_transient`): the S3
client's own attempts (`storage.s3_max_attempts`, with backoff) are the one bound on a stall.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from longstraw.errors import UserError, exception_chain
from longstraw.schemas.run import RunConfig
from longstraw.storage.errors import ChunkChecksumError, StateIntegrityError
from longstraw.training.preflight import human_size

EX_IOERR = 74
"""sysexits.h: an input/output error. A storage fault is the environment's, not the config's
(exit status 2): an orchestrator may retry it once the volume or the endpoint is back."""

RESUME_HINT = "then resume the run (longstraw train … --resume, or the flow with resume=true)"

_FULL = {errno.ENOSPC, errno.EDQUOT}
_READ_ONLY = {errno.EROFS}
_DENIED = {errno.EACCES, errno.EPERM}
_IO = {errno.EIO}
# Rust and C libraries (safetensors, zarr's codecs) say the errno in their message only.
_ERRNO_IN_TEXT = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")

VOLUME_FAULTS = frozenset({"full", "read-only", "permission", "io"})
"""Faults of the local volume (vs. the S3 endpoint's, or a damaged state's bytes)."""

F = TypeVar("F", bound=Callable)


class StorageFault(UserError):
    """The storage under a run failed it; the message names the path, the cause and the fix."""

    exit_code = EX_IOERR

    def __init__(self, what: str, fix: str, *, path: str, kind: str):
        super().__init__(what, fix, path, kind)
        self.what, self.fix, self.path, self.kind = what, fix, path, kind
        self.resume_hint = RESUME_HINT

    def __str__(self) -> str:
        return f"{self.what} — {self.fix}, {self.resume_hint}"

    def __reduce__(self):
        # Prefect keeps a failed task's exception (pickled); the keyword arguments must survive.
        return (_rebuild, (self.what, self.fix, self.path, self.kind, self.resume_hint))


def _rebuild(what: str, fix: str, path: str, kind: str, resume_hint: str) -> StorageFault:
    fault = StorageFault(what, fix, path=path, kind=kind)
    fault.resume_hint = resume_hint
    return fault


def storage_faults(stage: F) -> F:
    """Make a stage (first argument: the RunConfig) raise a StorageFault for a storage fault."""

    @functools.wraps(stage)
    def wrapper(*args, **kwargs):
        try:
            return stage(*args, **kwargs)
        except StorageFault:
            raise
        except Exception as exc:
            fault = storage_fault(exc, args[0], doing=f"stage {stage.__name__}")
            if fault is None:
                raise
            raise fault from exc

    return wrapper  # type: ignore[return-value]


def storage_fault(
    exc: BaseException, config: RunConfig, *, doing: str | None = None
) -> StorageFault | None:
    """The StorageFault that `exc` (or an exception in its chain) is, or None."""
    chain = list(exception_chain(exc))
    for error in chain:
        if isinstance(error, StorageFault):
            return error
    for error in chain:
        if isinstance(error, StateIntegrityError):
            return damaged_state(error)
    # Before the OSErrors: s3fs turns an S3 error answer into one (HTTP 500 -> EREMOTEIO,
    # 503 -> EBUSY, an unknown code -> EIO, AccessDenied -> PermissionError), which would read
    # as a fault of the local volume.
    for error in chain:
        if (fault := _s3_fault(error, config)) is not None:
            return fault
    for error in chain:
        if isinstance(error, OSError) and error.errno in _FULL | _READ_ONLY | _DENIED | _IO:
            return _os_fault(error.errno, error.filename, config, doing)
    for error in chain:
        match = _ERRNO_IN_TEXT.search(str(error))
        code = int(match.group(1) or match.group(2)) if match else None
        if code in _FULL | _READ_ONLY | _DENIED | _IO:
            return _os_fault(code, None, config, doing)
    return None


def _os_fault(
    code: int, filename: str | None, config: RunConfig, doing: str | None
) -> StorageFault:
    from longstraw.storage.checkpoints import local_root

    root = local_root(config.storage)
    volume = _volume(filename, root)
    # A checkpoint is written into `<version>.tmp-<id>`, removed when the write fails.
    where = re.sub(r"\.tmp-[0-9a-f]+", "", str(filename)) if filename else (doing or "a file")
    if code in _FULL:
        free = shutil.disk_usage(volume).free if volume.exists() else 0
        writes = _step_writes(config) if volume == root else None
        if writes:
            total = sum(writes.values())
            parts = ", ".join(f"{name} {human_size(n)}" for name, n in writes.items() if n)
            fix = (
                f"free at least {human_size(max(total - free, 0) or total)} there (one step "
                f"writes about {human_size(total)}: {parts}), or point storage at a larger volume"
            )
        else:
            fix = "free space there, or point storage at a larger volume"
        return StorageFault(
            f"no space left on the volume of {volume} ({human_size(free)} free) writing {where}",
            fix,
            path=str(filename or volume),
            kind="full",
        )
    if code in _READ_ONLY:
        return StorageFault(
            f"{volume} is on a read-only file system (EROFS) writing {where}",
            "remount it read-write (a volume that hit I/O errors is remounted read-only by the "
            "kernel: check dmesg first), or point storage at a writable volume",
            path=str(filename or volume),
            kind="read-only",
        )
    if code in _DENIED:
        return StorageFault(
            f"permission denied on {where} (uid {os.getuid()}, {errno.errorcode[code]})",
            f"give uid {os.getuid()} write access to {volume} again (chown / chmod), or point "
            "storage at a directory it can write",
            path=str(filename or volume),
            kind="permission",
        )
    return StorageFault(
        f"input/output error (EIO) on {where} under {volume}",
        "check the device (dmesg, the volume's health), or point storage at another volume",
        path=str(filename or volume),
        kind="io",
    )


def _volume(filename: str | None, root: Path) -> Path:
    """The storage root when `filename` lies under it (or is unknown), else the nearest existing
    directory of `filename` (a fault outside the root: the Prefect home, a temp directory)."""
    if filename is None:
        return root
    path = Path(os.fsdecode(filename)).absolute()
    if path.is_relative_to(root):
        return root
    for parent in (path, *path.parents):
        if parent.is_dir():
            return parent
    return root


def _step_writes(config: RunConfig) -> dict[str, int] | None:
    """What one step writes under the local root (preflight's estimate), or None."""
    from longstraw.training.preflight import check_prompts, step_write_bytes

    try:
        writes = step_write_bytes(config, check_prompts(config))
    except Exception:  # the estimate is a courtesy; the fault is reported without it
        return None
    if not config.storage.root_uri.startswith("file://"):
        writes.pop("prompt states")  # they go to the bucket
    return writes


_S3_TRANSIENT_CODES = frozenset(
    {"PriorRequestNotComplete", "RequestThrottled", "RequestTimeout", "Throttling", "SlowDown"}
)
"""S3 error codes below HTTP 500 that botocore's retry mode retries as the server's trouble."""

_S3_CREDENTIAL_CODES = frozenset(
    {
        "AccessDenied",
        "AccountProblem",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "RequestTimeTooSkewed",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
    }
)
"""S3 error codes that mean the credentials no longer do (a session token expired, a key was
revoked, this machine's clock drifted): the preflight's probe passed with them at the start."""


def _s3_fault(error: BaseException, config: RunConfig) -> StorageFault | None:
    try:
        from botocore.exceptions import ClientError, HTTPClientError
        from botocore.exceptions import ConnectionError as BotoConnectionError
    except ImportError:
        return None
    storage = config.storage
    if isinstance(error, ClientError):
        # An answer: the server's trouble (5xx and throttling, after botocore's retries) or the
        # credentials' (not retried); any other code (NoSuchKey, …) is not the storage's fault.
        code = error.response.get("Error", {}).get("Code", "?")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        answered = f"answered HTTP {status} {code} to {error.operation_name}"
        endpoint = _endpoint(None, storage)
        if status >= 500 or code in _S3_TRANSIENT_CODES:
            what = (
                f"{endpoint} {answered} at {storage.root_uri}, after "
                f"{storage.s3_max_attempts} attempts"
            )
            fix = (
                "check the S3 server's health and logs, or raise storage.s3_max_attempts to "
                "wait out a longer outage (each attempt backs off up to 20 s)"
            )
        elif code in _S3_CREDENTIAL_CODES or status == 403:
            what = f"{endpoint} refused the credentials ({answered}) at {storage.root_uri}"
            fix = (
                "renew or correct them (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                "AWS_SESSION_TOKEN: a session token expires; AWS_PROFILE), check that they may "
                f"write under {storage.root_uri} and that this machine's clock is right"
            )
        else:
            return None
        return StorageFault(what, fix, path=storage.root_uri, kind="s3")
    if not isinstance(error, BotoConnectionError | HTTPClientError):
        return None
    from longstraw.storage.s3_client import failure_description

    what = failure_description(error, None, storage.s3_read_timeout_s) or (
        f"failed ({type(error).__name__}: {error})"
    )
    url = getattr(error, "kwargs", {}).get("endpoint_url")
    fix = (
        "check that the S3 server is running and reachable there (storage.s3_endpoint_url, "
        "AWS_ENDPOINT_URL_S3)"
    )
    if "did not answer" in what:
        fix += ", or raise storage.s3_read_timeout_s for a slow one"
    return StorageFault(
        f"{_endpoint(url, storage)} {what} at {_object_uri(url, storage)}, after "
        f"{storage.s3_max_attempts} attempts",
        fix,
        path=_object_uri(url, storage),
        kind="s3",
    )


def _endpoint(url: str | None, storage) -> str:
    """'S3 endpoint http://host:port' of the request that failed (a rank's own route, the
    environment's AWS_ENDPOINT_URL_S3), else of the config; 'the S3 endpoint' for AWS's."""
    parts = urlsplit(url) if url else None
    endpoint = f"{parts.scheme}://{parts.netloc}" if parts and parts.netloc else None
    endpoint = endpoint or storage.s3_endpoint_url
    return f"S3 endpoint {endpoint}" if endpoint else "the S3 endpoint"


def _object_uri(url: str | None, storage) -> str:
    """http://host:port/bucket/key?query (or https://bucket.host/key) -> s3://bucket/key; the
    root when unknown. Of the query only a listing's prefix is said (it may carry an upload id)."""
    if not url:
        return storage.root_uri
    from longstraw.storage.s3_client import request_target

    parts = urlsplit(url)
    path = request_target(url).lstrip("/")
    bucket = urlsplit(storage.root_uri).netloc
    if bucket and parts.netloc.startswith(f"{bucket}."):  # virtual-hosted style
        path = f"{bucket}/{path}"
    return f"s3://{path}"


def damaged_state(error: StateIntegrityError) -> StorageFault:
    """A prompt state whose stored bytes differ from its manifest: name it and how to drop it."""
    uri = error.uri if isinstance(error, ChunkChecksumError) else _uri_in(str(error))
    # `<state dir>/attempt-<id>/state.zarr/...` or `<state dir>/COMMITTED.json`.
    state = re.split(r"/attempt-|/COMMITTED\.json", uri)[0] if uri else "the prompt state"
    remove = (
        f"aws s3 rm --recursive {state}/"
        if state.startswith("s3://")
        else f"rm -r {state.removeprefix('file://')}"
    )
    detail = str(error)
    if uri:
        detail = detail.replace(f" ({uri})", "")
    return StorageFault(
        f"prompt state {state} is damaged: {detail}",
        f"remove that state ({remove}) and it is prefilled again (`longstraw state verify "
        "<state dir>` re-reads every chunk of a state against its manifest)",
        path=state,
        kind="damaged-state",
    )


def _uri_in(text: str) -> str | None:
    match = re.search(r"((?:file|s3)://\S+|/\S+)", text)
    return match.group(1).rstrip("),:;") if match else None
