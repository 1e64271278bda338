"""Run a training step's stages on every rank of a sequence group, driven from rank 0.

The training loop (or the Prefect flow) runs in one process, the driver, which is rank 0. A stage
that works on the model (prefill, rollout, scoring, backward, update, checkpoint) is decorated
with `on_all_ranks`: called on the driver, it first tells every other rank to call the same
function with the same arguments (refs and configs: small, picklable), then runs it as rank 0;
the other ranks sit in `StageGroup.serve`. The stage's collectives therefore meet, and a stage
is written once, as SPMD code, whatever the world size.

Where the ranks come from:

* `torchrun` (several nodes, c10d rendezvous): it sets RANK / WORLD_SIZE / MASTER_ADDR; every
  process runs `longstraw train`; rank 0 drives, the others serve until the driver stops them.
* no launcher: the driver spawns ranks 1..N-1 on this machine (rendezvous on 127.0.0.1).

Control messages (which stage, its arguments, each rank's outcome) go over a gloo group, the
tensors' traffic over `parallel.backend` (NCCL on GPUs). After every stage, the ranks exchange
their outcome, so an error on any rank fails the stage on all of them with that rank's
traceback; a rank that died breaks the connections and fails the driver's next collective with
`RankFailedError`.

Data-parallel replicas (`parallel.data_parallel: R`): the world is R replicas of S sequence ranks
(`topology.Topology`, built once here where the group starts). The driver drives each replica from a thread of its own, its "lane"
(`on_replica(d)`): a stage called in lane d runs on replica d's ranks only, over that replica's
groups (`Replica`), so the replicas run different groups at once. Between `replicas_serving()`'s
entry and exit the serving ranks listen to their replica's channel instead of the world's; the
stages that span the replicas (plan, reduce, update, checkpoint) run outside it, on every rank.

A `UserError` in a stage (a storage fault: a full disk, a damaged state; a failing reward) ends
the run as the same one line on any rank. It may come in the middle of the stage's collectives,
so it does not wait for the outcome exchange: the driver raises its own at once; a serving rank
puts its (pickled) error in the group's store and leaves the group, which fails the driver's
next collective with it at once, and the driver raises that rank's error (the rank's traceback
rides on it as its cause). Either way the group is over: `stop` ends the spawned ranks without
waiting for them.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import faulthandler
import functools
import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longstraw.distributed.launch import RankFailedError, free_port
from longstraw.distributed.topology import Topology
from longstraw.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])

_STOP = "__stop__"
_REPLICAS = "__replicas__"
"""World command: every serving rank listens to its replica's channel until `_LEAVE`."""
_LEAVE = "__leave__"
_FAULT_KEY = "longstraw/stage-fault"
"""Store key of a serving rank's UserError: (rank, stage, traceback, pickled error)."""
_PR_SET_PDEATHSIG = 1
_EXIT_GRACE_S = 5.0
"""How long a failed collective waits for a spawned rank's exit to show before it is raised as
it came."""


@dataclass(frozen=True)
class Replica:
    """One data-parallel replica: S consecutive ranks that share each of its prompts' states."""

    index: int
    """d: which replica (global ranks d · S … d · S + S - 1)."""
    ranks: tuple[int, ...]
    control: dist.ProcessGroup | None
    """gloo group of the replica's ranks: the Python objects a stage passes between them (None:
    the default group, where the replica is the whole world)."""
    sequence: dist.ProcessGroup | None
    """The replica's ranks on `parallel.backend`: the prompt state's traffic (None: the default
    group)."""
    channel: dist.ProcessGroup | None
    """gloo group of rank 0 and the replica's ranks: the driver's commands and the stage's
    outcome (replica 0's is `control`, rank 0 being its first rank)."""

    @property
    def size(self) -> int:
        return len(self.ranks)


def replica_groups(topology: Topology, backend: str, timeout) -> list[Replica]:
    """Every replica's groups (collective: every rank creates every group, in the same order)."""
    replicas = []
    for d in range(topology.replicas):
        ranks = topology.replica_ranks(d)
        control = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        sequence = (
            control
            if backend == "gloo"
            else dist.new_group(list(ranks), backend=backend, timeout=timeout)
        )
        channel = (
            control if d == 0 else dist.new_group([0, *ranks], backend="gloo", timeout=timeout)
        )
        replicas.append(Replica(d, ranks, control, sequence, channel))
    return replicas


def data_groups(topology: Topology, backend: str, timeout) -> list:
    """[S] groups of the ranks with the same sequence index across the replicas (rank s, S + s,
    …): where the replicas' gradients are summed (collective, like `replica_groups`)."""
    return [
        dist.new_group(list(topology.data_ranks(s)), backend=backend, timeout=timeout)
        for s in range(topology.sequence_ranks)
    ]


class StageGroup:
    """The ranks of one run — their `Topology` and its groups —; rank 0 drives (`call`), the
    others `serve`."""

    def __init__(
        self,
        topology: Topology,
        control: dist.ProcessGroup,
        procs: list,
        store: dist.Store | None = None,
        replicas: list[Replica] = (),
        data_group: dist.ProcessGroup | None = None,
    ):
        self.topology = topology
        self.control = control
        self.replicas = list(replicas)
        """Each data-parallel replica's groups (empty with one replica: it is the world)."""
        self.data_group = data_group
        """This rank's group across the replicas (None with one replica)."""
        self.procs = procs
        """Ranks this process spawned (empty under torchrun and on serving ranks)."""
        self.store = store
        """The rendezvous store: where a serving rank leaves the UserError that ended it."""
        self.broken = False
        """A stage ended in a UserError: the ranks are no longer in step."""
        self.own_failure: Exception | None = None
        """The first error a stage raised on this rank (the driver reports the run's)."""
        self.serving = threading.local()

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def replica(self) -> Replica | None:
        """This rank's replica (None with one replica)."""
        if not self.replicas:
            return None
        return self.replicas[self.topology.replica]

    def inside_stage(self) -> bool:
        return getattr(self.serving, "active", False)

    def scope(self) -> Replica | None:
        """The replica the stage running in this thread spans (None: every rank)."""
        return getattr(self.serving, "scope", None)

    def lane(self) -> int | None:
        """The replica this driver thread's stage calls go to (`on_replica`; None: every rank)."""
        return getattr(self.serving, "lane", None)

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Run stage `name` on every rank — or, in a replica's lane, on that replica's ranks —;
        the result of rank 0 (of the replica's first rank)."""
        assert self.is_driver, "only rank 0 drives stages"
        assert not self.broken, "the rank group ended with a failed stage; start a new one"
        lane = self.lane()
        replica = None if lane is None else self.replicas[lane]
        try:
            if replica is None:
                dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self.control)
                return self._run(name, args, kwargs)
            dist.broadcast_object_list([(name, args, kwargs)], group=replica.channel, group_src=0)
            if replica.index == 0:
                return self._run(name, args, kwargs, replica)
            return self._relay(name, replica)
        except (RankFailedError, UserError):
            raise
        except (RuntimeError, ConnectionError) as error:
            reported = self.reported_error()
            if reported is not None:
                self.broken = True
                raise reported from reported.__cause__
            dead = self.dead_rank(wait_s=_EXIT_GRACE_S)
            if dead is not None:
                rank, code = dead
                raise RankFailedError(
                    rank, f"process exited with code {code} during stage {name}", code
                ) from error
            raise

    def _relay(self, name: str, replica: Replica) -> Any:
        """The outcome of stage `name` on `replica` (the driver is not one of its ranks): its
        first rank's result, or its failure."""
        outcomes: list[Any] = [None] * (replica.size + 1)
        dist.all_gather_object(outcomes, (None, None), group=replica.channel)
        _raise_failure(name, [failure for failure, _ in outcomes])
        return outcomes[1][1]

    def _run(self, name: str, args: tuple, kwargs: dict, replica: Replica | None = None) -> Any:
        fn = _resolve(name)
        self.serving.active = True
        self.serving.scope = replica
        try:
            result, failure = fn(*args, **kwargs), None
        except Exception as error:  # reported to every rank below
            if self.own_failure is None:
                self.own_failure = error
            if isinstance(error, UserError) and self._end_with(error, name):
                raise
            result, failure = None, (self.rank, type(error).__name__, traceback.format_exc())
            if not self.is_driver:
                # Said at once: the driver may be waiting in a collective this rank never joins,
                # and then only the group's timeout ends the stage.
                sys.stderr.write(f"rank {self.rank}: stage {name} raised:\n{failure[2]}")
                sys.stderr.flush()
        finally:
            self.serving.active = False
            self.serving.scope = None
        if replica is None:
            outcomes: list[Any] = [None] * self.world_size
            dist.all_gather_object(outcomes, failure, group=self.control)
            _raise_failure(name, outcomes)
            return result
        # A replica's first rank hands its result to the driver when the driver is not it.
        relayed = result if self.rank == replica.ranks[0] and self.rank != 0 else None
        members = replica.size + (replica.index != 0)
        gathered: list[Any] = [None] * members
        dist.all_gather_object(gathered, (failure, relayed), group=replica.channel)
        _raise_failure(name, [f for f, _ in gathered])
        return result

    def _end_with(self, error: UserError, name: str) -> bool:
        """A UserError ends the group (the other ranks may be in a collective this rank never
        joins): the driver raises it; a serving rank leaves it in the store, then the group.
        False where it cannot be left there (the outcome exchange then says it)."""
        if not self.is_driver:
            try:
                report = pickle.dumps((self.rank, name, traceback.format_exc(), error))
                self.store.set(_FAULT_KEY, report)
            except Exception:  # not picklable, or no store
                return False
        self.broken = True
        return True

    def reported_error(self) -> UserError | None:
        """The UserError a serving rank left in the store (its traceback as the cause)."""
        try:
            if self.store is None or not self.store.check([_FAULT_KEY]):
                return None
            rank, name, detail, error = pickle.loads(self.store.get(_FAULT_KEY))
        except Exception:  # a store gone with the ranks: nothing to say beyond the failure
            return None
        error.__cause__ = RankFailedError(
            rank, f"stage {name} raised {type(error).__name__} on rank {rank}:\n{detail}"
        )
        return error

    def serve(self) -> None:
        """Run the driver's stages until it stops the group (serving ranks only)."""
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, src=0, group=self.control)
            name, args, kwargs = message[0]
            if name == _STOP:
                return
            if name == _REPLICAS:
                if not self._serve_replica():
                    return
                continue
            try:
                self._run(name, args, kwargs)
            except RankFailedError:
                pass  # the driver raises it; a serving rank goes on to the next command
            except UserError:
                return  # left in the store for the driver: this rank leaves the group

    def _serve_replica(self) -> bool:
        """Run the stages the driver sends this rank's replica until it leaves replica mode;
        False where a UserError ended this rank's part in the group."""
        replica = self.replica
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, group=replica.channel, group_src=0)
            name, args, kwargs = message[0]
            if name == _LEAVE:
                return True
            try:
                self._run(name, args, kwargs, replica)
            except RankFailedError:
                pass
            except UserError:
                return False

    def enter_replicas(self) -> None:
        """Every serving rank listens to its replica's channel (driver; a no-op with one)."""
        if self.replicas:
            dist.broadcast_object_list([(_REPLICAS, (), {})], src=0, group=self.control)

    def leave_replicas(self) -> None:
        """Every serving rank listens to the world's channel again (driver)."""
        for replica in self.replicas:
            dist.broadcast_object_list([(_LEAVE, (), {})], group=replica.channel, group_src=0)

    def dead_rank(self, wait_s: float = 0.0) -> tuple[int, int] | None:
        """(rank, exit code) of a spawned rank that has exited, if any; waiting up to `wait_s`
        for one to show (a killed rank's sockets close before its exit can be reaped, so the
        collective that fails with it may be told first)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.exitcode is not None:
                    return rank, proc.exitcode
            if time.monotonic() >= deadline or not self.procs:
                return None
            time.sleep(0.05)

    def stop(self) -> None:
        """Release the serving ranks and the process group (driver)."""
        if self.is_driver and self.dead_rank() is None and not self.broken:
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([(_STOP, (), {})], src=0, group=self.control)
        for proc in self.procs:
            if self.broken:
                proc.terminate()  # it may wait in a collective the driver never joins
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _raise_failure(name: str, failures: list[Any]) -> None:
    failed = [f for f in failures if f is not None]
    if failed:
        rank, kind, detail = failed[0]
        raise RankFailedError(rank, f"stage {name} raised {kind} on rank {rank}:\n{detail}")


_active: StageGroup | None = None
_active_lock = threading.Lock()
_after_stop: list[Callable[[], None]] = []
"""Cleanups `when_ranks_stop` deferred until the ranks are stopped."""


def active_group() -> StageGroup | None:
    return _active


def active_topology() -> Topology:
    """The run's ranks as this process sees them (one process: every degree at 1)."""
    return Topology() if _active is None else _active.topology


def stage_ranks() -> tuple[int, int]:
    """(this rank's index, the number of ranks) among those running the current stage: its
    replica's, or every rank's; (0, 1) in a single process."""
    if _active is None:
        return 0, 1
    scope, topology = _active.scope(), _active.topology
    if scope is None:
        return topology.rank, topology.world_size
    return topology.sequence_rank, topology.sequence_ranks


def stage_control() -> dist.ProcessGroup | None:
    """The gloo group of the ranks running the current stage (its replica's, or the world's)."""
    scope = _active.scope()
    return _active.control if scope is None else scope.control


def is_writer() -> bool:
    """True on the process that writes the current stage's shared files: the first rank of the
    ranks running it (rank 0, or its replica's first rank), or the only process."""
    return stage_ranks()[0] == 0


def from_writer(value: Any) -> Any:
    """The writer's `value` on every process running the stage (the others pass a placeholder):
    what only the writer computes or writes (rewards, a checkpoint's ref) and every rank
    records. One process: `value`."""
    if _active is None:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, group=stage_control(), group_src=0)
    return shared[0]


@contextlib.contextmanager
def replicas_serving() -> Iterator[None]:
    """The block's stages may run in replica lanes (`on_replica`): the serving ranks listen to
    their replicas (driver; a no-op without replicas). A group that broke inside is left as is
    (`stop` ends it)."""
    group = _active
    if group is None or not group.replicas:
        yield
        return
    group.enter_replicas()
    try:
        yield
    except BaseException:
        # A stage that failed on live ranks left them in step: they go back to the world's
        # channel. A dead rank or a broken group has no step to keep (`stop` ends it).
        if not group.broken and group.dead_rank() is None:
            with contextlib.suppress(Exception):
                group.leave_replicas()
        raise
    group.leave_replicas()


@contextlib.contextmanager
def on_replica(index: int) -> Iterator[None]:
    """This thread's stage calls run on replica `index` (inside `replicas_serving`; a no-op
    without replicas)."""
    group = _active
    if group is None or not group.replicas:
        yield
        return
    group.serving.lane = index
    try:
        yield
    finally:
        group.serving.lane = None


def _resolve(name: str) -> Callable[..., Any]:
    module, _, qualname = name.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return getattr(target, "__wrapped__", target)


def on_all_ranks(fn: F) -> F:
    """Make a stage SPMD: with a stage group started, the driver's call runs `fn` on every rank.

    `fn`'s first argument is the RunConfig; a driver with `parallel.world_size > 1` and no group
    yet starts one."""
    name = f"{fn.__module__}:{fn.__qualname__}"

    @functools.wraps(fn)
    def stage(*args, **kwargs):
        config = args[0]
        group = _active
        if group is None and config.parallel.world_size > 1:
            group = start_stage_group(config.parallel)
        if group is None or group.inside_stage():
            return fn(*args, **kwargs)
        if group.world_size != config.parallel.world_size:
            raise ValueError(
                f"parallel.world_size is {config.parallel.world_size} but this process runs in a "
                f"group of {group.world_size} ranks; use one world size per process"
            )
        return group.call(name, args, kwargs)

    return stage  # type: ignore[return-value]


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _die_with_parent() -> None:
    """Linux: a spawned rank gets SIGKILL when its driver dies, so no rank outlives a killed run."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _join(rank: int, parallel, init_method: str = "env://") -> StageGroup:
    topology, backend = Topology.of(parallel, rank), parallel.backend
    timeout = datetime.timedelta(seconds=parallel.timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=topology.rank,
        world_size=topology.world_size,
        timeout=timeout,
    )
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    store = dist.distributed_c10d._get_default_store()
    replicas, data_group = [], None
    if topology.replicas > 1:
        replicas = replica_groups(topology, backend, timeout)
        data_group = data_groups(topology, backend, timeout)[topology.sequence_rank]
    return StageGroup(topology, control, [], store, replicas, data_group)


def _serve_spawned(rank: int, parallel, port: int) -> None:
    _die_with_parent()
    # `kill -USR1 <pid>` prints where a serving rank is (a hang's first question).
    faulthandler.register(signal.SIGUSR1)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(_threads_per_rank(parallel.world_size))
    global _active
    _active = _join(rank, parallel, f"tcp://127.0.0.1:{port}")
    try:
        _active.serve()
    finally:
        _active.stop()


def _serving_exit_status(group: StageGroup) -> int:
    """A torchrun serving rank's exit status: 0, or — where a stage failed on this rank — the
    status `longstraw train` gives that error (74 for a storage fault, 2 for another user
    error, 1 otherwise), after one line on this rank's log. A rank that failed must not look
    done to its node's scheduler, and its torchrun agent then stops at once instead of waiting
    out the exit barrier of a run whose driver is gone."""
    error = group.own_failure
    if error is None:
        return 0
    if isinstance(error, UserError):
        line = "; ".join(part.strip() for part in str(error).splitlines())
        sys.stderr.write(f"error: rank {group.rank}: {line} (rank 0 ends the run)\n")
        sys.stderr.flush()
        return getattr(error, "exit_code", 2)
    return 1  # its traceback was written when the stage raised


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def start_stage_group(parallel) -> StageGroup | None:
    """Join (torchrun) or start (local spawn) the run's ranks; None for world_size 1.

    On a serving rank this call does not return: it serves the driver's stages, then exits.
    """
    global _active
    with _active_lock:
        if _active is not None:
            return _active
        if parallel.world_size == 1:
            return None
        if launched_by_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world != parallel.world_size:
                raise ValueError(
                    f"parallel.world_size is {parallel.world_size} but torchrun started "
                    f"{world} processes; set parallel.world_size: {world} (nnodes × nproc-per-node)"
                )
            group = _join(int(os.environ["RANK"]), parallel)
            if not group.is_driver:
                _active = group
                try:
                    group.serve()
                finally:
                    group.stop()
                sys.exit(_serving_exit_status(group))
        else:
            port = free_port()
            context = mp.get_context("spawn")
            procs = [
                context.Process(
                    target=_serve_spawned,
                    args=(rank, parallel, port),
                    daemon=True,
                )
                for rank in range(1, parallel.world_size)
            ]
            for proc in procs:
                proc.start()
            # Not through os.environ: processes this driver starts later must not look like
            # torchrun ranks.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            torch.set_num_threads(_threads_per_rank(parallel.world_size))
            try:
                group = _join(0, parallel, f"tcp://127.0.0.1:{port}")
            except BaseException:
                for proc in procs:
                    proc.kill()
                raise
            group.procs = procs
        _active = group
        atexit.register(stop_stage_group)
        return group


def when_ranks_stop(cleanup: Callable[[], None]) -> None:
    """Call `cleanup` once the run's ranks are stopped (one process: now). For what a failed
    stage of the writer leaves behind that another rank may still be writing into: removing it
    at once would fail that rank's write with an error of its own."""
    if _active is None:
        cleanup()
        return
    with _active_lock:
        _after_stop.append(cleanup)


def stop_stage_group() -> None:
    """Stop the run's ranks (driver), then run what `when_ranks_stop` deferred; a no-op without
    a group."""
    global _active
    with _active_lock:
        group, _active = _active, None
        cleanups = _after_stop[:]
        _after_stop.clear()
    if group is not None:
        group.stop()
    for cleanup in cleanups:
        with contextlib.suppress(Exception):
            cleanup()
