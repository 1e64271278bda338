"""The `train` flow: steps of `grpo_step` with checkpoints, resume and the run's audit artifacts."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, tags

from longstraw.audit.completions import RunCompletions
from longstraw.audit.curves import publish_run_curves
from longstraw.audit.names import run_tags, step_tags
from longstraw.flows.grpo_step import grpo_step
from longstraw.schemas.overrides import RunConfigOverrides, as_overrides
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig, merged, validated_run_config
from longstraw.storage.config_files import read_run_config
from longstraw.tasks.stages import open_run
from longstraw.trackers.run_trackers import open_trackers
from longstraw.training import progress
from longstraw.training.run_start import preflight, run_opened


def run_config(
    config: RunConfigOverrides | dict[str, Any] | None,
    config_file: str | None,
    deployment_config: RunConfigOverrides | dict[str, Any] | None = None,
) -> RunConfig:
    """The run's config: `config_file` (a path or URI) or, without one, the defaults; then the
    `config` of the deployment the run was created from; then the run's own `config`. Each is
    merged field by field onto the config the ones before it give (`schemas.run.merged`), so an
    override changes only what it names (Prefect alone would replace the parameter whole)."""
    layers = (as_overrides(deployment_config), as_overrides(config))
    if config_file is not None:
        return read_run_config(config_file, *layers)
    return validated_run_config(merged({}, *layers), "flow parameter `config`")


def deployment_config() -> dict[str, Any] | None:
    """The `config` parameter of the deployment this flow run was created from (None when it
    was called directly)."""
    from prefect import get_client
    from prefect.runtime import deployment

    if deployment.id is None:
        return None
    # Read the deployment itself: `prefect.runtime.deployment.parameters` are the flow run's.
    with get_client(sync_client=True) as client:
        return (client.read_deployment(deployment.id).parameters or {}).get("config")


def train_run_name() -> str:
    """The flow run's name in the UI: the run id (`r1`, `r1 resumed`), or the config file's name
    when the run id comes from the file."""
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    config = merged({}, as_overrides(deployment_config()), as_overrides(parameters.get("config")))
    run_id = config.get("run_id")
    name = run_id or Path(parameters.get("config_file") or "longstraw-train").stem
    return f"{name} resumed" if parameters.get("resume") else name


@flow(name="longstraw-train", flow_run_name=train_run_name)
def train(
    config: RunConfigOverrides | None = None,
    resume: bool = False,
    config_file: str | None = None,
) -> list[StepMetrics]:
    """Run `num_steps` GRPO steps (continuing after the latest checkpoint with `resume`).

    `config_file` names a YAML run config (a path or URI: in the image, on a volume, in S3);
    `config` holds overrides merged onto it field by field (`{"run_id": "x"}` changes the run id
    and nothing else), or onto the defaults when there is no file. A run of a deployment merges
    its `config` onto the config the deployment would run, the same way.
    """
    logger = get_run_logger()
    announce_flow_run()
    config = run_config(config, config_file, deployment_config())
    preflight(config, resume)
    with run_opened(config, resume, open_run) as (policy, recorded):
        tag_flow_run(config, policy.step if resume else None)
        if policy.step:
            logger.info(
                "resuming run %s at step %d (policy version %d)",
                config.run_id,
                policy.step,
                policy.policy_version,
            )
        history = []
        # Whatever this flow run did, its curves and completions hold every recorded step of
        # the run: the resumed parts, and the steps before a failure.
        completions = RunCompletions(config)
        try:
            with open_trackers(config, recorded) as trackers:
                while policy.step < config.train.num_steps:
                    with tags(*step_tags(config.run_id, policy.step, policy.policy_version)):
                        policy, metrics = grpo_step(config, policy)
                    history.append(metrics)
                    trackers.log_step(metrics)
                    completions.publish(publish_run_curves(config))
        except BaseException:
            # The failure is what the run reports; artifacts that cannot be published on the way
            # out (the same full or read-only volume) must not replace it.
            with contextlib.suppress(Exception):
                completions.publish(publish_run_curves(config))
            raise
        completions.publish(publish_run_curves(config))
    return history


def announce_flow_run() -> None:
    """Tell this process's listeners (`longstraw train`'s console) the flow run's page in the
    Prefect UI: `<PREFECT_UI_URL>/runs/flow-run/<id>`; None where no UI URL is known."""
    from prefect.runtime import flow_run
    from prefect.utilities.urls import url_for

    if flow_run.id is None:
        return
    progress.emit("flow_run", id=flow_run.id, ui_url=url_for("flow-run", obj_id=flow_run.id))


def tag_flow_run(config: RunConfig, resumed_at_step: int | None) -> None:
    """Tag this flow run `run:<id>` (the run id comes from its config, after the flow started)
    and a resume `resumed-at:step-N`: every flow run of a training run is found by that tag."""
    from prefect import get_client
    from prefect.runtime import flow_run

    if flow_run.id is None:
        return
    new = set(run_tags(config.run_id))
    if resumed_at_step is not None:
        new.add(f"resumed-at:step-{resumed_at_step}")
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(flow_run.id)
        client.update_flow_run(flow_run.id, tags=sorted(set(current.tags) | new))
