"""hydra/launcher=kubernetes without a cluster (none can be reached here): the TrainJobs it writes are validated
against the TrainJob CRD's OpenAPI schema of Kubeflow Trainer v2.3.0 (tests/data), and a node's command from the
manifest really runs here, under torchrun, with the variables Trainer's torch runtime gives a node."""

from __future__ import annotations

import base64
import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import jsonschema
import pytest
import yaml
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, losses_by_step, one_line_error

from hydra_plugins.trainflow_launchers.kubernetes_launcher import SPEC_MOUNT, job_return, summary_from_log

CRD = Path(__file__).parent / "data" / "trainer.kubeflow.org_trainjobs.v2.3.0.yaml"
KUBERNETES = ["hydra/launcher=kubernetes", "hydra.launcher.image=registry.example/trainflow:0.1.0",
              "hydra.launcher.volume_claim=trainflow-runs"]


def multirun(sweep_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python train.py -m ...` as users type it, into sweep_dir."""
    base = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return run_process([sys.executable, str(ROOT / "train.py"), "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
                       cwd=ROOT, env={**base, **(env or {})}, timeout=120)


def strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused: the API server would prune them silently (a misspelt field
    is a setting lost), so a manifest trainflow writes must have none."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def trainjob_schema() -> Any:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return strict(version["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-job sweep of 2 nodes x 2 ranks written as manifests."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    proc = multirun(sweep_dir, *TINY_GPT, *KUBERNETES, "hydra.launcher.dry_run=true", "hydra.launcher.nodes=2",
                    "hydra.launcher.cpu_per_node=4", "hydra.launcher.memory_per_node=8Gi", "parallelism=ddp",
                    "parallelism.nproc_per_node=2", "parallelism.max_restarts=1", "data=synthetic",
                    "trainer.max_steps=3", "trainer.seed=1,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir


def objects(sweep_dir: Path, num: int) -> dict[str, dict]:
    return {o["kind"]: o for o in yaml.safe_load_all((sweep_dir / "kubernetes" / f"{num}.yaml").read_text())}


def test_dry_run_writes_a_trainjob_per_job_that_the_crd_schema_accepts(dry_run: Path, trainjob_schema: Any) -> None:
    names = set()
    for num in (0, 1):
        manifest = objects(dry_run, num)
        job = manifest["TrainJob"]
        jsonschema.validate(job, trainjob_schema)
        names.add(job["metadata"]["name"])
        assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
        assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                             "name": "torch-distributed"}
        trainer = job["spec"]["trainer"]
        assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 2
        assert trainer["image"] == "registry.example/trainflow:0.1.0"
        assert trainer["resourcesPerNode"]["limits"] == {"cpu": "4", "memory": "8Gi"}
        script = trainer["command"][2]
        assert "-m torch.distributed.run --nproc-per-node=2 --max-restarts=1 " \
               "-m hydra_plugins.trainflow_launchers._worker" in script
        (patch,) = job["spec"]["runtimePatches"]
        pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["trainflow-sweep"]["persistentVolumeClaim"] == {"claimName": "trainflow-runs"}
        assert volumes["trainflow-job"]["configMap"] == {"name": job["metadata"]["name"]}
        mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        # the job's folder (checkpoints, outputs) is at the path the composed config names, on the user's volume
        assert mounts["trainflow-sweep"]["mountPath"] == str(dry_run) and \
            mounts["trainflow-sweep"]["subPath"] == dry_run.name
        # the ConfigMap ships the composed job: its overrides and its folder
        config_map = manifest["ConfigMap"]
        assert config_map["metadata"]["name"] == job["metadata"]["name"]
        _, _, shipped, _ = cloudpickle.loads(base64.b64decode(config_map["binaryData"]["job.pkl"]))
        assert shipped.dir == dry_run / str(num) and f"trainer.seed={num + 1}" in shipped.overrides
        assert shipped.config.trainer.seed == num + 1
    assert len(names) == 2
    assert not (dry_run / "0" / "summary.json").exists()  # nothing ran


def test_the_schema_refuses_a_wrong_manifest(dry_run: Path, trainjob_schema: Any) -> None:
    """The check bites: a count as text, or a field the CRD does not have, is refused."""
    job = objects(dry_run, 0)["TrainJob"]
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["trainer"]["numNodes"] = "2"
    unknown = copy.deepcopy(job)
    unknown["spec"]["trainer"]["numNode"] = 2
    for manifest in (wrong_type, unknown):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(manifest, trainjob_schema)


def test_a_nodes_command_trains_the_job_here_and_hands_its_summary_back(dry_run: Path) -> None:
    """What runs in a pod, run on this machine: the node command of job 0's TrainJob, with its ConfigMap's file
    where the pod mounts it and the variables Trainer's torch runtime sets (one node here), trains the job into its
    folder on 2 ranks and prints its summary, which the launcher turns into the job's result."""
    manifest = objects(dry_run, 0)
    spec_dir = dry_run / "configmap"
    spec_dir.mkdir()
    (spec_dir / "job.pkl").write_bytes(base64.b64decode(manifest["ConfigMap"]["binaryData"]["job.pkl"]))
    command = manifest["TrainJob"]["spec"]["trainer"]["command"]
    command = [*command[:2], command[2].replace(SPEC_MOUNT, str(spec_dir))]
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "PET_NNODES": "1",
           "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "localhost", "PET_MASTER_PORT": str(port),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # `python` is the image's: this one here
    node = run_process(command, cwd=ROOT, env=env, timeout=300)
    assert node.returncode == 0, (node.stdout + node.stderr)[-3000:]
    job_dir = dry_run / "0"
    summary = summary_from_log(node.stdout)
    assert summary is not None and json.loads(summary) == json.loads((job_dir / "summary.json").read_text())
    assert json.loads(summary)["world_size"] == 2 and len(losses_by_step(job_dir)) == 3
    _, _, shipped, _ = cloudpickle.loads((spec_dir / "job.pkl").read_bytes())
    ret = job_return(shipped, summary)
    assert ret.status.name == "COMPLETED" and ret.return_value == json.loads(summary)["validation"]["loss"]


def test_without_a_kubeconfig_submitting_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes extra: pip install 'trainflow[kubernetes]'")
    proc = multirun(tmp_path / "sweep", *KUBERNETES, "trainer.max_steps=1",
                    env={"KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)})
    assert one_line_error(proc).startswith("Error: hydra.launcher.kubeconfig: no Kubernetes cluster configured (")
    assert not (tmp_path / "sweep" / "0").exists()


@pytest.mark.parametrize(("drop", "expected"), [
    ("hydra.launcher.image=registry.example/trainflow:0.1.0", "Error: hydra.launcher.image: a TrainJob needs a "
     "container image with trainflow installed"),
    ("hydra.launcher.volume_claim=trainflow-runs", "Error: hydra.launcher.volume_claim: the jobs' folders"),
])
def test_a_missing_image_or_volume_is_one_line(tmp_path: Path, drop: str, expected: str) -> None:
    proc = multirun(tmp_path, *[o for o in KUBERNETES if o != drop], "hydra.launcher.dry_run=true")
    assert one_line_error(proc).startswith(expected)
    assert not (tmp_path / "kubernetes").exists()
