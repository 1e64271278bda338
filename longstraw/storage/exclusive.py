"""Create-if-absent for commit markers: the one primitive the commit protocol relies on.

Local: write a temp file, then os.link it to the final name; link(2) fails atomically if the
name exists, so exactly one of any number of racing writers creates it, and a reader never sees
a partly written file. No fsync: the protocol guards against writers that die (the page cache
survives them); after a machine crash a chunk that did not reach the disk is caught by its size
or sha256 on read. An fsync here made ext4 flush every chunk written before it (data=ordered),
which capped writes at the disk's speed (170 MB/s measured vs 1.7 GB/s into the page cache). S3: a PUT with If-None-Match: * (s3fs
pipe_file(mode="create")); the server answers 412 to every writer but the first.
"""

from __future__ import annotations

import os
import time
import uuid

import fsspec

from longstraw.storage.paths import is_local

# AWS answers 409 ConditionalRequestConflict while another conditional PUT on the key is in
# flight; the outcome is then decided by retrying (a few hundred ms covers it).
_CONFLICT_RETRIES = 8
_CONFLICT_SLEEP_S = 0.05


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Create `path` holding `data` unless it exists. True: we created it; False: it existed."""
    if is_local(fs):
        return _create_exclusive_local(path, data)
    for attempt in range(_CONFLICT_RETRIES):
        try:
            fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if "Conditional" not in str(e) or attempt == _CONFLICT_RETRIES - 1:
                raise
            time.sleep(_CONFLICT_SLEEP_S * (attempt + 1))
    raise AssertionError("unreachable")


def _create_exclusive_local(path: str, data: bytes) -> bool:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True
