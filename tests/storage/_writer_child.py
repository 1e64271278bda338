"""Child process for the crash test: write shards in order and stop INSIDE shard `kill_at`
(its chunks written, its manifest not yet), print IN_SHARD and wait to be SIGKILLed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import helpers

import longstraw.storage.writer as writer_mod
from longstraw.schemas.storage import StateKey, StorageConfig


def main(root_uri: str, dtype: str, kill_at: int) -> None:
    layout = helpers.make_layout(dtype)
    state = helpers.make_state(layout)
    real_write_chunks = writer_mod.write_chunks
    calls = {"n": 0}

    def write_chunks_then_hang(*args, **kwargs):
        out = real_write_chunks(*args, **kwargs)
        if calls["n"] == kill_at:
            print("IN_SHARD", flush=True)
            time.sleep(600)
        calls["n"] += 1
        return out

    writer_mod.write_chunks = write_chunks_then_hang
    key = StateKey.policy("run", 1, "w", f"crash-{dtype}")
    w = writer_mod.open_state_writer(StorageConfig(root_uri=root_uri), key, layout)
    helpers.run_prefill(w, layout, state)
    w.commit()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
