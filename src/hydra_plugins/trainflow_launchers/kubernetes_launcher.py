"""`hydra/launcher=kubernetes`: each job of a sweep becomes one Kubeflow Trainer `TrainJob` (trainer.kubeflow.org/
v1alpha1).

A job is two objects: a ConfigMap holding the pickled job (its composed config, `${now:}` and all, as every other
launcher ships it) and a TrainJob that refers to a torch training runtime (Trainer's `torch-distributed` by
default) with the job's nodes, ranks per node, resources per node and image. Trainer's torch runtime exports
torchrun's settings to every node (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT); each
node's container copies the job out of the ConfigMap and runs trainflow's worker under torchrun. The user's
PersistentVolumeClaim is mounted at the sweep folder's own path, so the job's directory, checkpoints and outputs
in the pods are where the composed config says; node 0 prints the job's summary.json at its end, between two
marker lines, and the launcher writes it into the local sweep folder: the report and the skip of finished jobs
work as on the other launchers.

With a kubeconfig the launcher creates both objects through the Kubernetes Python client, waits for the
TrainJobs' Complete or Failed condition, and keeps node 0's log in `<job>/kubernetes/node-0.log`. A rank that
fails is restarted by torchrun up to the job's restarts; a lost node is the runtime's JobSet failure policy's
to restart, and a trainflow job resumes from its last committed checkpoint on the volume. `dry_run=true`
writes the manifests to `<sweep dir>/kubernetes/` and submits nothing.
"""

import base64
import hashlib
import json
import logging
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cloudpickle
import yaml
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus

from hydra_plugins.trainflow_launchers.common import (
    JobShape,
    SweepJob,
    SweepLauncher,
    failure_reason,
    finished_already,
    job_shape,
    log_outcome,
    user_error,
)
from hydra_plugins.trainflow_launchers.config import KubernetesLauncherConf
from trainflow.record.sweep_outcome import monitor_value

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
CONTAINER = "node"  # the trainer container (and replicated job) of Trainer's torch runtimes
SPEC_MOUNT = "/etc/trainflow"  # where a node sees its job's ConfigMap
SUMMARY_BEGIN = "----- trainflow summary.json begin -----"
SUMMARY_END = "----- trainflow summary.json end -----"
MANAGER = "trainflow.launcher"  # the owner of the TrainJob's runtime patch


class KubernetesLauncher(SweepLauncher):
    def __init__(self, **params: Any) -> None:
        super().__init__(KubernetesLauncherConf(**params))

    def check(self) -> None:
        check_conf(self.conf)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        jobs = self.compose(job_overrides, initial_job_idx)
        own = {"nproc_per_node": self.conf.nproc_per_node, "max_restarts": self.conf.max_restarts}
        shapes = {job.num: job_shape(job, "nproc_per_node", own, lambda: self.conf.gpus_per_node) for job in jobs}
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        state = Singleton.get_state()
        if self.conf.dry_run:
            folder = sweep_dir / "kubernetes"
            folder.mkdir(parents=True, exist_ok=True)
            for job in jobs:
                spec = cloudpickle.dumps((self.hydra_context, self.task_function, job, state))
                objects = manifests(self.conf, job, shapes[job.num], sweep_dir, spec, name=job_name(sweep_dir, job))
                path = folder / f"{job.num}.yaml"
                path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
                log.info("\t%s -> %s", job.describe(), path)
            log.info("dry run: the TrainJob and ConfigMap of %d jobs are in %s; nothing was submitted", len(jobs),
                     folder)
            return []
        api = connect(self.conf)
        done = {job.num: ret for job in jobs if (ret := finished_already(job)) is not None}
        todo = [job for job in jobs if job.num not in done]  # the same sweep again: only unfinished jobs go
        names = {}
        for job in todo:
            spec = cloudpickle.dumps((self.hydra_context, self.task_function, job, state))
            names[job.num] = name = job_name(sweep_dir, job, suffix=f"{int(time.time()) % 100000:05d}")
            api.submit(manifests(self.conf, job, shapes[job.num], sweep_dir, spec, name=name))
            log.info("\t%s -> TrainJob %s/%s", job.describe(), self.conf.namespace, name)
        for job in todo:
            done[job.num] = self.wait(api, job, names[job.num])
            log_outcome(f"#{job.num} ({names[job.num]})", done[job.num], job.dir)
        return [done[job.num] for job in jobs]

    def wait(self, api: "KubernetesApi", job: SweepJob, name: str) -> JobReturn:
        """Follow one TrainJob to its end, keeping node 0's log; its JobReturn from the summary node 0 printed."""
        console = job.dir / "kubernetes" / "node-0.log"
        console.parent.mkdir(parents=True, exist_ok=True)
        shown = 0
        while True:
            condition = api.finished(name)
            text = api.node_log(name)
            if text is not None:
                console.write_text(text)
                print(text[shown:], end="", flush=True)
                shown = len(text)
            if condition is not None:
                break
            time.sleep(self.conf.poll_interval_s)
        text = console.read_text() if console.exists() else ""
        summary = summary_from_log(text)
        if condition == "Complete" and summary is not None:
            try:
                ret = job_return(job, summary)  # the log is the cluster's: JSON, read as data, or no result
            except ValueError:
                ret = None
            if ret is not None:
                (job.dir / "summary.json").write_text(summary)
                return ret
        reason = failure_reason(text) or "see its log"
        return self.failed(job, None, f"job #{job.num} failed on Kubernetes (TrainJob {self.conf.namespace}/{name}, "
                                      f"{condition}): {reason} [log: {console}]")


def job_return(job: SweepJob, summary_text: str) -> JobReturn:
    """A completed job's JobReturn from its summary.json, as Hydra's sweepers take it (the monitored value)."""
    summary = json.loads(summary_text)
    if not isinstance(summary, dict):
        raise ValueError("a summary is a JSON object")
    return JobReturn(overrides=job.overrides, cfg=job.config, working_dir=str(job.dir), status=JobStatus.COMPLETED,
                     _return_value=monitor_value(summary))


def job_name(sweep_dir: Path, job: SweepJob, suffix: str = "") -> str:
    """A TrainJob name unique to the sweep folder and job (a DNS label: 63 characters at most)."""
    digest = hashlib.sha256(str(sweep_dir).encode()).hexdigest()[:8]
    return "-".join(part for part in ("trainflow", digest, str(job.num), suffix) if part)


def node_command(job: SweepJob, ranks_per_node: int, max_restarts: int) -> list[str]:
    """What each node's container runs: the job copied out of its ConfigMap into a folder of the node's own in the
    job's directory, trainflow's worker under torchrun (its nodes, rank and master from Trainer's PET_ variables),
    then on node 0 the job's summary.json between two marker lines, for the launcher."""
    folder = shlex.quote(str(job.dir / "kubernetes"))
    summary = shlex.quote(str(job.dir / "summary.json"))
    script = "\n".join([
        f'node="{folder}/$(hostname)"',
        'mkdir -p "$node" && cp ' + f'{SPEC_MOUNT}/job.pkl "$node/job.pkl" || exit 1',
        f'python -m torch.distributed.run --nproc-per-node={ranks_per_node} --max-restarts={max_restarts} '
        '-m hydra_plugins.trainflow_launchers._worker "$node/job.pkl"',
        "rc=$?",
        f'if [ "${{PET_NODE_RANK:-0}}" = 0 ] && [ -f {summary} ]; then',
        f"  echo {shlex.quote(SUMMARY_BEGIN)}; cat {summary}; echo; echo {shlex.quote(SUMMARY_END)}",
        "fi",
        "exit $rc",
    ])
    return ["sh", "-c", script]


def manifests(c: KubernetesLauncherConf, job: SweepJob, shape: JobShape, sweep_dir: Path, spec: bytes,
              name: str) -> list[dict[str, Any]]:
    """The ConfigMap with the pickled job, and the TrainJob that runs it."""
    labels = {"app.kubernetes.io/managed-by": "trainflow", "trainflow/job": str(job.num)}
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": c.namespace, "labels": labels},
        "binaryData": {"job.pkl": base64.b64encode(spec).decode()},
    }
    resources: dict[str, Any] = {}
    if c.cpu_per_node:
        resources["cpu"] = c.cpu_per_node
    if c.memory_per_node:
        resources["memory"] = c.memory_per_node
    if c.gpus_per_node:
        resources["nvidia.com/gpu"] = c.gpus_per_node
    trainer: dict[str, Any] = {
        "image": c.image,
        "numNodes": c.nodes,
        "numProcPerNode": int(shape.ranks_per_node),
        "command": node_command(job, int(shape.ranks_per_node), shape.max_restarts),
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
    }
    if resources:
        trainer["resourcesPerNode"] = {"requests": dict(resources), "limits": dict(resources)}
    volumes = [{"name": "trainflow-job", "configMap": {"name": name}},
               {"name": "trainflow-sweep", "persistentVolumeClaim": {"claimName": c.volume_claim}}]
    mounts = [{"name": "trainflow-job", "mountPath": SPEC_MOUNT, "readOnly": True},
              {"name": "trainflow-sweep", "mountPath": str(sweep_dir), "subPath": c.volume_sub_path or sweep_dir.name}]
    pod = {"spec": {"template": {"spec": {"volumes": volumes,
                                          "containers": [{"name": CONTAINER, "volumeMounts": mounts}]}}}}
    train_job = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJob",
        "metadata": {"name": name, "namespace": c.namespace, "labels": labels},
        "spec": {
            "runtimeRef": {"apiGroup": GROUP, "kind": c.runtime_kind, "name": c.runtime},
            "trainer": trainer,
            "runtimePatches": [{"manager": MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": CONTAINER, "template": pod}]}}}}],
        },
    }
    return [config_map, train_job]


def summary_from_log(text: str) -> str | None:
    """The summary.json node 0 printed between the marker lines at its end (the last one, after restarts)."""
    end = text.rfind(SUMMARY_END)
    begin = text.rfind(SUMMARY_BEGIN, 0, end)
    if begin < 0 or end < 0:
        return None
    return text[begin + len(SUMMARY_BEGIN):end].strip() + "\n"


class KubernetesApi:
    """The few calls the launcher makes, through the Kubernetes Python client."""

    def __init__(self, c: KubernetesLauncherConf, client: Any) -> None:
        self.conf = c
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()
        self.errors = client.exceptions.ApiException

    def submit(self, objects: list[dict[str, Any]]) -> None:
        config_map, train_job = objects
        ns = self.conf.namespace
        try:
            self.core.create_namespaced_config_map(ns, config_map)
            self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, train_job)
        except self.errors as exc:
            user_error(f"hydra.launcher.namespace: Kubernetes refused TrainJob {ns}/{train_job['metadata']['name']} "
                       f"({exc.status} {exc.reason}: {str(exc.body or '')[:300]}); check the namespace, the runtime "
                       f"{self.conf.runtime!r} and your permissions")

    def finished(self, name: str) -> str | None:
        """"Complete" or "Failed" once the TrainJob has that condition; None while it runs."""
        job = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.conf.namespace, PLURAL, name)
        for condition in (job.get("status") or {}).get("conditions") or []:
            if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
                return condition["type"]
        return None

    def node_log(self, name: str) -> str | None:
        """The log of node 0's container (its pod of the replicated job `node`, completion index 0)."""
        selector = (f"jobset.sigs.k8s.io/jobset-name={name},jobset.sigs.k8s.io/replicatedjob-name={CONTAINER},"
                    "batch.kubernetes.io/job-completion-index=0")
        pods = self.core.list_namespaced_pod(self.conf.namespace, label_selector=selector).items
        if not pods:
            return None
        try:
            return self.core.read_namespaced_pod_log(pods[-1].metadata.name, self.conf.namespace, container=CONTAINER)
        except self.errors:  # not started yet
            return None


def connect(c: KubernetesLauncherConf) -> KubernetesApi:
    """The cluster of the kubeconfig (or of this pod); none is one line."""
    try:
        from kubernetes import client, config  # lazy: the kubernetes extra, only when jobs are submitted
    except ImportError:
        user_error("hydra/launcher=kubernetes: the Kubernetes client is not installed; pip install "
                   "'trainflow[kubernetes]' (or set hydra.launcher.dry_run=true to write the manifests only)")
    try:
        config.load_kube_config(config_file=c.kubeconfig)
    except Exception as exc:  # no kubeconfig: try the service account of a pod
        try:
            config.load_incluster_config()
        except config.ConfigException:
            user_error(f"hydra.launcher.kubeconfig: no Kubernetes cluster configured ({str(exc).strip()[:200]}); "
                       "set KUBECONFIG or hydra.launcher.kubeconfig, or hydra.launcher.dry_run=true to write the "
                       "manifests only")
    return KubernetesApi(c, client)


def check_conf(c: KubernetesLauncherConf) -> None:
    """Settings a TrainJob needs, named by their key."""
    if not c.image:
        user_error("hydra.launcher.image: a TrainJob needs a container image with trainflow installed; set "
                   "hydra.launcher.image=<registry>/<image>:<tag>")
    if not c.volume_claim:
        user_error("hydra.launcher.volume_claim: the jobs' folders, checkpoints and outputs live on a volume every "
                   "node mounts; set hydra.launcher.volume_claim=<PersistentVolumeClaim name>")
    for key, value, least in (("nodes", c.nodes, 1), ("nproc_per_node", c.nproc_per_node, 1),
                              ("max_restarts", c.max_restarts, 0), ("gpus_per_node", c.gpus_per_node, 0)):
        if value is not None and value < least:
            user_error(f"hydra.launcher.{key}: must be >= {least}; got {value}")
    if c.runtime_kind not in ("ClusterTrainingRuntime", "TrainingRuntime"):
        user_error(f"hydra.launcher.runtime_kind: must be ClusterTrainingRuntime or TrainingRuntime; got "
                   f"{c.runtime_kind!r}")
    if c.poll_interval_s <= 0:
        user_error(f"hydra.launcher.poll_interval_s: must be > 0 seconds; got {c.poll_interval_s}")
