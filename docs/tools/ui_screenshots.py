"""Screenshots of what a team sees in the Prefect UI for a LongStraw run (docs/orchestration.md).

Starts a Prefect server on 127.0.0.1 (its own PREFECT_HOME in a temporary directory), runs
`longstraw train` against it on a tiny model built from a config (`examples/run.yaml` with a
1K-token prompt, two groups per step), and photographs, with headless Chromium, the train flow
run's page (its steps as subflows) and its first step subflow (the task runs, named for what
they did, and their logs). Everything stays on loopback and is removed afterwards; only the
PNGs are kept.

    python docs/tools/ui_screenshots.py --out docs/img        # needs `chromium` (apt)

Prints each file it wrote. Runs for about two minutes on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "kv-retrieval"
WINDOW = "1600,1000"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def api_get(api: str, path: str):
    with urllib.request.urlopen(f"{api}{path}", timeout=10) as reply:
        return json.loads(reply.read())


def api_post(api: str, path: str, body: dict):
    request = urllib.request.Request(
        f"{api}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


@contextlib.contextmanager
def prefect_server(home: Path):
    """A Prefect server with its UI on a free loopback port; yields its API URL."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # The UI's scripts call the API at this address (by default port 4200's).
        "PREFECT_UI_API_URL": api,
        "PREFECT_SERVER_UI_API_URL": api,
    }
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
    server = subprocess.Popen(
        [*command, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(OSError):
                if api_get(api, "/health") is True:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Prefect server on port {port} did not start")
            time.sleep(1)
        yield api
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def train(api: str, work: Path) -> str:
    """Run a short training against the server; the train flow run's UI address."""
    config = yaml.safe_load((REPO / "examples" / "run.yaml").read_text())
    config["run_id"] = RUN_ID
    config["data"]["task"]["num_prompt_tokens"] = 1024
    config["engine"]["shard_tokens"] = 256
    config["train"].update(num_steps=3, groups_per_step=2, checkpoint_every=1)
    config["storage"]["root_uri"] = str(work / "root")
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(work / "client-home")}
    result = subprocess.run(
        [sys.executable, "-m", "longstraw.cli", "train", "--config", "run.yaml"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"longstraw train failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    found = re.search(r"Prefect UI: (\S+)", result.stdout)
    if found is None:
        raise RuntimeError(f"longstraw train printed no UI link:\n{result.stdout[-3000:]}")
    return found.group(1)


def first_step_subflow(api: str) -> str:
    """The id of the run's first step subflow (`<run-id>/step-0000`)."""
    runs = api_post(
        api,
        "/flow_runs/filter",
        {"flow_runs": {"name": {"any_": [f"{RUN_ID}/step-0000"]}}, "limit": 1},
    )
    if not runs:
        raise RuntimeError(f"no flow run named {RUN_ID}/step-0000 on the server")
    return runs[0]["id"]


def screenshot(chromium: str, url: str, out: Path) -> None:
    """Photograph `url` once the page's scripts had 40 s of virtual time to fetch and draw it."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={WINDOW}",
                "--virtual-time-budget=40000",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    print(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    if shutil.which(args.chromium) is None:
        sys.exit(
            f"{args.chromium} not found: install Chromium (apt install chromium) or pass --chromium"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, prefect_server(Path(tmp) / "server-home") as api:
        work = Path(tmp)
        run_page = train(api, work)
        ui = run_page.split("/runs/")[0]
        screenshot(args.chromium, run_page, args.out / "ui_train_run.png")
        step = first_step_subflow(api)
        screenshot(args.chromium, f"{ui}/runs/flow-run/{step}", args.out / "ui_step_subflow.png")


if __name__ == "__main__":
    main()
