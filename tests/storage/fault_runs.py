"""What the storage-fault tests share: a run of the tiny model through `longstraw train` in a
directory of its own, with a reward that does the fault's damage mid-run; its one-line check;
the tensors of a checkpoint; a TCP proxy in front of the loopback S3 server."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

from longstraw.training.storage_faults import EX_IOERR

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


def write_run(directory: Path, checkpoint: Path, storage: dict | None, **extra) -> Path:
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


def run_train(
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


def assert_one_error_line(rc: int, lines: list[str], *needles: str) -> str:
    text = "\n".join(lines)
    assert rc == EX_IOERR, text[-4000:]
    assert lines[-1].startswith("error: "), text[-4000:]
    assert len(lines) <= MAX_LINES, text[-4000:]
    assert "Traceback" not in text and "─────" not in text, text[-4000:]
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors files (weights, each rank's optimizer rows)."""
    from safetensors.torch import load_file

    return {
        f"{file.name}:{name}": tensor
        for file in sorted(checkpoint.glob("*.safetensors"))
        for name, tensor in load_file(file).items()
    }


class S3Proxy:
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
