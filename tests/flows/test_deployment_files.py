"""prefect.yaml and the Kubernetes GPU base job template agree with each other and with the code."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from longstraw.schemas.run import RunConfig

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "infra" / "k8s-gpu-base-job-template.json"


def _deployments() -> dict[str, dict]:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {d["name"]: d for d in spec["deployments"]}


def _render(job_variables: dict) -> dict:
    """What a Kubernetes worker makes of the template: defaults, then the job variables."""
    from prefect.utilities.templating import apply_values

    template = json.loads(TEMPLATE.read_text())
    properties = template["variables"]["properties"]
    values = {k: v["default"] for k, v in properties.items() if "default" in v} | job_variables
    return apply_values(template["job_configuration"], values)


def test_deployments_point_at_the_train_flow_with_valid_default_parameters():
    from prefect.flows import load_flow_from_entrypoint

    deployments = _deployments()
    assert set(deployments) == {"local", "gpu"}
    for deployment in deployments.values():
        flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]))
        assert flow.name == "longstraw-train"
        RunConfig.model_validate(deployment["parameters"]["config"])
    assert deployments["local"]["work_pool"]["name"] == "longstraw-local"
    assert deployments["gpu"]["work_pool"]["name"] == "longstraw-gpu"


def test_every_gpu_job_variable_is_a_template_variable():
    # Prefect silently drops job variables that match no template variable (docs/design.md).
    properties = json.loads(TEMPLATE.read_text())["variables"]["properties"]
    job_variables = _deployments()["gpu"]["work_pool"]["job_variables"]
    assert set(job_variables) <= set(properties), set(job_variables) - set(properties)
    for name in ("gpu_count", "node_selector", "tolerations"):
        assert name in properties


def test_gpu_count_maps_to_the_nvidia_gpu_limit_with_node_selector_and_tolerations():
    rendered = _render(
        {
            "image": "registry.example.com/longstraw:0.1",
            "gpu_count": 4,
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    )
    pod = rendered["job_manifest"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["image"] == "registry.example.com/longstraw:0.1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # Checkpoints are written to a local directory: the run's storage root is a mounted volume.
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    claims = [
        v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] == "data"
    ]
    assert claims == ["longstraw-data"]

    defaults = _render({})["job_manifest"]["spec"]["template"]["spec"]
    assert defaults["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert defaults["tolerations"][0]["key"] == "nvidia.com/gpu"
