"""Reading W&B's offline run files (`offline-run-*-<id>/run-<id>.wandb`) back: the records a run
wrote, as wandb's own protobuf messages. wandb 0.31 ships the message schema but no reader for
the file, which is a LevelDB log: a 7-byte header, then 32 KiB blocks of chunks, each with a
7-byte header (crc32c, length, type: full, first, middle, last)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

HEADER = b":W&B"
FILE_HEADER_BYTES = 7
BLOCK_BYTES = 32768
CHUNK_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def record_bytes(path: Path) -> Iterator[bytes]:
    """Each complete record of one .wandb file, in order (a record cut by a crash is dropped)."""
    data = path.read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path} is not a W&B run file (no {HEADER!r} header)")
    pos, pending = FILE_HEADER_BYTES, None
    while pos + CHUNK_HEADER.size <= len(data):
        left = BLOCK_BYTES - pos % BLOCK_BYTES
        if left < CHUNK_HEADER.size:  # the block's zero padding
            pos += left
            continue
        _, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0:  # zeros: padding to the block's end
            pos += left
            continue
        chunk = data[pos + CHUNK_HEADER.size : pos + CHUNK_HEADER.size + length]
        if len(chunk) < length:
            return
        pos += CHUNK_HEADER.size + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE and pending is not None:
            pending += chunk
        elif kind == LAST and pending is not None:
            yield pending + chunk
            pending = None


def run_files(directory: Path, run_id: str) -> list[Path]:
    """The .wandb files of W&B run `run_id` under `directory` (one per process that logged to it,
    oldest first)."""
    return sorted((directory / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def history(directory: Path, run_id: str) -> list[tuple[int, dict[str, object]]]:
    """(step, {key: value}) of every history row run `run_id` wrote, in order; a table is its
    `<name>/...` keys (`<name>/_type` "table-file", `<name>/path` its JSON under files/)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in run_files(directory, run_id):
        for data in record_bytes(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            values = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append((record.history.step.num, values))
    return rows
