"""Run a `BenchSpec` in its own process under a wall-clock and an RSS cap.

The parent polls the child's VmRSS every 50 ms and kills it (SIGKILL) when it passes the memory
cap, or when it passes the time cap. Either is recorded (status "oom" / "timeout", with the peak
RSS seen so far as a lower bound of what the run would have needed), never dropped. RLIMIT_AS is
not used: torch reserves far more address space than it touches, so a virtual-memory cap fails
runs whose resident memory is small.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.grpo.workload import BenchSpec

_POLL_S = 0.05
_ERROR_TAIL_CHARS = 2000


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def run_isolated(spec: BenchSpec, *, time_cap_s: float, mem_cap_bytes: int) -> dict:
    """One configuration in a fresh `python -m bench.grpo.worker` process; a result record.

    Record: spec, status ("ok", "oom", "timeout", "error"), wall_s, observed_peak_rss_bytes
    (parent's polls) and, when ok, the worker's result (peak_rss_bytes = child's ru_maxrss).
    """
    with tempfile.TemporaryDirectory(prefix="longstraw-bench-") as tmp:
        out = Path(tmp) / "result.json"
        log = Path(tmp) / "worker.log"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        # Spinning OpenMP workers burn the CPU a descheduled partner needs on a shared machine.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        started = time.perf_counter()
        with open(log, "wb") as log_file:
            child = subprocess.Popen(
                [sys.executable, "-m", "bench.grpo.worker", spec.model_dump_json(), str(out)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
            )
            observed_peak, status = 0, None
            while child.poll() is None:
                observed_peak = max(observed_peak, _rss_bytes(child.pid))
                elapsed = time.perf_counter() - started
                if observed_peak > mem_cap_bytes:
                    status = "oom"
                elif elapsed > time_cap_s:
                    status = "timeout"
                if status is not None:
                    child.send_signal(signal.SIGKILL)
                    child.wait()
                    break
                time.sleep(_POLL_S)
        wall = time.perf_counter() - started
        record = {
            "spec": spec.model_dump(),
            "wall_s": wall,
            "observed_peak_rss_bytes": observed_peak,
            "time_cap_s": time_cap_s,
            "mem_cap_bytes": mem_cap_bytes,
        }
        tail = log.read_text(errors="replace")[-_ERROR_TAIL_CHARS:] if log.exists() else ""
        if status is None and child.returncode == 0 and out.exists():
            result = json.loads(out.read_text())
            record.update(status="ok", result=result)
        elif status is None:
            # Killed by the kernel's OOM killer (SIGKILL we did not send) or a MemoryError.
            oom = child.returncode == -signal.SIGKILL or "MemoryError" in tail
            record.update(status="oom" if oom else "error", error=tail)
        else:
            record.update(status=status)
        return record
