"""Run a function on N local ranks under one gloo/NCCL process group, failing cleanly.

`run_on_ranks(fn, world_size, *args)` spawns N processes (`torch.multiprocessing`, spawn context),
each joins a process group rendezvoused on 127.0.0.1 at a free port (the env:// variables torchrun
sets, so code run under torchrun sees the same environment), calls `fn(rank, world_size, *args)`
and sends its result back. A rank that raises reports its traceback; a rank that dies without a
word (SIGKILL, os._exit, OOM) is noticed by its exit code. Either way the other ranks — which would
otherwise block forever in their next collective — are terminated and `RankFailedError` names the
rank. Collectives carry a timeout too, so no configuration can hang past `timeout_s`.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Poll interval of the parent: how quickly a dead rank is noticed.
_POLL_S = 0.05
# Grace period for a terminated rank before SIGKILL.
_TERMINATE_GRACE_S = 5.0


class RankFailedError(RuntimeError):
    """A rank raised or died; `rank` is the first one seen failing, `detail` its traceback.

    `exit_code` is set when the rank died without a word (killed, OOM, preempted): rerunning may
    succeed (and resumes from recorded prefill shards); a rank that raised fails the same way.
    """

    def __init__(self, rank: int, detail: str, exit_code: int | None = None):
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail
        self.exit_code = exit_code


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_local_process_group(
    rank: int, world_size: int, port: int, *, backend: str = "gloo", timeout_s: float = 120.0
) -> None:
    """Join the group with torchrun's env:// variables, on loopback only."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    # gloo picks an interface by hostname otherwise; keep all traffic on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    num_threads: int,
    results: Any,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> None:
    try:
        torch.set_num_threads(num_threads)
        init_local_process_group(rank, world_size, port, backend=backend, timeout_s=timeout_s)
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    backend: str = "gloo",
    num_threads: int = 1,
    start_method: str = "spawn",
    **kwargs: Any,
) -> list[Any]:
    """[world_size] results of `fn(rank, world_size, *args, **kwargs)` run on local ranks.

    `fn` must be importable (a module-level function: spawn pickles it by name) and return
    something picklable; tensors should be small (tests, statistics). `num_threads` intra-op
    threads per rank (ranks × threads should not exceed the cores). `start_method` "spawn" is
    the safe default (CUDA cannot be forked); "fork" skips re-importing torch/transformers in
    each rank (seconds per rank) and suits CPU-only runs such as the tests. Raises `RankFailedError` as
    soon as any rank fails or dies, and `TimeoutError` after `timeout_s`; all ranks are stopped.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                port,
                backend,
                timeout_s,
                num_threads,
                results,
                fn,
                args,
                kwargs,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=_POLL_S)
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if rank not in values and proc.exitcode not in (None, 0):
                        # Died without reporting; give a report in flight a moment to land.
                        time.sleep(_POLL_S)
                        if results.empty():
                            raise RankFailedError(
                                rank,
                                f"process exited with code {proc.exitcode} without a result",
                                proc.exitcode,
                            ) from None
                        break
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise TimeoutError(
                        f"ranks {missing} did not finish within {timeout_s:.0f} s; raise timeout_s "
                        "or look for a rank stuck outside a collective"
                    ) from None
                continue
            if not ok:
                raise _root_cause(procs, values, rank, value)
            values[rank] = value
        finished = True
    finally:
        _stop(procs, graceful=finished)
    return [values[rank] for rank in range(world_size)]


def _root_cause(procs: list, values: dict, rank: int, detail: str) -> RankFailedError:
    """A rank's error is often the echo of another rank's death (a closed connection): name the
    rank that died without a result if there is one, with the reporting rank's traceback."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        for other, proc in enumerate(procs):
            if other != rank and other not in values and proc.exitcode not in (None, 0):
                return RankFailedError(
                    other,
                    f"process exited with code {proc.exitcode} without a result; "
                    f"rank {rank} then failed with:\n{detail}",
                    proc.exitcode,
                )
        time.sleep(_POLL_S)
    return RankFailedError(rank, detail)


def _stop(procs: list, *, graceful: bool) -> None:
    """Join finished ranks; terminate the rest (they would block in their next collective)."""
    if graceful:
        for proc in procs:
            proc.join(timeout=_TERMINATE_GRACE_S)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=_TERMINATE_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
