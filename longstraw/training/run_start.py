"""Starting a run, written once for every entry point: `longstraw train` (with or without
Prefect), the Prefect flow (also run by a deployment's worker) and `training.loop.train`.

In order: the config is checked before any work (`preflight`: every user error in one line);
the run's lease is taken (one writer per run); a run that has a committed checkpoint is only
ever continued, never restarted over; the rank group is joined or started (world size 1: none);
the run opens at its latest checkpoint (`resume`) or the configured model; the metrics rows of
an abandoned attempt are settled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from longstraw.distributed.stage_group import active_group, start_stage_group, stop_stage_group
from longstraw.errors import UserError
from longstraw.schemas.refs import PolicyRef
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import latest_checkpoint, run_dir
from longstraw.training.metrics import read_metrics, settle_metrics
from longstraw.training.preflight import preflight
from longstraw.training.run_lease import check_run_lease, run_lease
from longstraw.training.stages import open_run

__all__ = ["preflight", "refuse_restart", "run_opened"]


def refuse_restart(config: RunConfig, resume: bool) -> None:
    """A run that has a committed checkpoint is continued (`resume`), never restarted over; a
    live writer of it is named first (the clearer reason to refuse)."""
    if resume or (found := latest_checkpoint(config.storage, config.run_id)) is None:
        return
    check_run_lease(config)
    raise UserError(
        f"run {config.run_id!r} already has a committed checkpoint ({found}) under "
        f"{config.storage.root_uri} — continue it with --resume (the flow: resume=true), or "
        "choose another run id"
    )


@contextlib.contextmanager
def run_opened(
    config: RunConfig,
    resume: bool,
    open_policy: Callable[[RunConfig, bool], PolicyRef] = open_run,
) -> Iterator[tuple[PolicyRef, list]]:
    """(the policy the run continues from, the metrics rows recorded so far) with the run's
    lease held and its ranks started for the duration of the block. `open_policy` opens the run
    (the flow passes its task of `open_run`, so that the start shows in its audit trail). A rank
    group this call started is stopped after the block; one started earlier (`longstraw train`
    starts it while the model loads) is left to its starter."""
    with run_lease(config):
        refuse_restart(config, resume)
        started_here = active_group() is None
        start_stage_group(config.parallel)
        try:
            policy = open_policy(config, resume)
            # Rows of steps after the starting checkpoint belong to an abandoned attempt; the
            # checkpointed step's row is restored if its process died before writing it.
            settle_metrics(config.storage, policy)
            yield policy, read_metrics(run_dir(config.storage, config.run_id))
        finally:
            if started_here:
                stop_stage_group()
