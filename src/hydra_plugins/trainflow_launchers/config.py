"""Typed configs of trainflow's launchers, registered as `hydra/launcher=process`, `torchrun`, `slurm`, `ray` and
`kubernetes` for any Hydra app.

Hydra imports this module while it scans `hydra_plugins` for plugins, so it
must stay light: no torch, no submitit, no ray, no kubernetes here.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

PACKAGE = "hydra_plugins.trainflow_launchers"


@dataclass
class ProcessLauncherConf:
    """Every job of a sweep in a fresh Python process, one after the other; a failed job does not stop the sweep."""

    _target_: str = f"{PACKAGE}.process_launcher.ProcessLauncher"


@dataclass
class TorchrunLauncherConf:
    """Each job of a sweep runs under torch's elastic agent (the torchrun CLI), one job after the other."""

    _target_: str = f"{PACKAGE}.torchrun_launcher.TorchrunLauncher"
    # workers per node of a Hydra app other than trainflow (a trainflow job runs its parallelism.nproc_per_node):
    # N, or auto | cpu | gpu as torchrun takes it; null: 1
    nproc_per_node: str | None = None
    nnodes: str = "1"  # N, or MIN:MAX for an elastic job
    rdzv_backend: str = "c10d"
    # host:port where the nodes meet (the first node hosts it); null on one node: a free local port
    rdzv_endpoint: str | None = None
    rdzv_id: str = "trainflow"  # the same on every node; job k of the sweep meets under "<rdzv_id>-<k>"
    rdzv_wait_s: float = 120.0  # how long a node waits for an endpoint on another host to answer
    # restarts of an app's whole worker group after a worker fails (a trainflow job: parallelism.max_restarts); null: 0
    max_restarts: int | None = None
    monitor_interval: float = 0.5  # seconds between the agent's checks of its workers
    shutdown_timeout_s: int = 30  # SIGTERM -> SIGKILL grace the agent gives its workers
    # forwarded by the agent to its workers (USR1/USR2: preemption notices of a scheduler)
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
    log_dir: str = "torchrun"  # inside each job's directory: the agent's log and every rank's stdout/stderr


@dataclass
class SlurmLauncherConf:
    """A sweep becomes one submitit job array; each array element is one job with nodes x tasks_per_node ranks."""

    _target_: str = f"{PACKAGE}.slurm_launcher.SlurmLauncher"
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    name: str = "${hydra.job.name}"
    nodes: int = 1
    gpus_per_node: int = 0
    # ranks per node of a Hydra app other than trainflow (a trainflow job runs its parallelism.nproc_per_node); null: 1
    tasks_per_node: int | None = None
    cpus_per_task: int | None = None
    mem_gb: int | None = None
    timeout_min: int = 60  # more than 10, or submitit takes every preemption notice for a timeout
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    signal_delay_s: int = 120  # USR2 this long before the time limit: time to save a checkpoint
    max_num_timeout: int = 3  # requeues after a time limit (preemptions do not count)
    array_parallelism: int = 256  # array elements running at once
    additional_parameters: dict[str, Any] = field(default_factory=dict)  # more #SBATCH lines: {key: value}
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (module load, source ...)
    srun_args: list[str] = field(default_factory=list)
    poll_interval_s: float = 2.0  # how often the launcher checks its jobs' states and pending reasons
    dry_run: bool = False  # write the sbatch script to the sweep dir and print its path; submit nothing


@dataclass
class RayLauncherConf:
    """Each job of a sweep runs as one gang of ranks on a Ray cluster, placed together by a placement group."""

    _target_: str = f"{PACKAGE}.ray_launcher.RayLauncher"
    # the cluster's address (the head's host:port that `ray start --head` prints, ray://host:10001, or auto for the
    # cluster started on this machine); null: the RAY_ADDRESS environment variable
    address: str | None = None
    nodes: int = 1  # nodes a job spreads its ranks over: nodes x ranks per node ranks in all
    # ranks per node of a Hydra app other than trainflow (a trainflow job runs its parallelism.nproc_per_node); null: 1
    nproc_per_node: int | None = None
    # restarts of a job's whole gang after a rank or node is lost, for an app other than trainflow (a trainflow job:
    # parallelism.max_restarts); null: 0
    max_restarts: int | None = None
    cpus_per_rank: float = 1.0  # Ray CPUs in each rank's bundle (also its OMP_NUM_THREADS, at least 1)
    gpus_per_rank: float = 0.0  # Ray GPUs in each rank's bundle
    max_concurrent: int = 8  # jobs of a sweep running at once; each also waits until the cluster has room for it
    shutdown_timeout_s: float = 30.0  # SIGTERM -> SIGKILL grace for a gang's ranks when it is stopped
    poll_interval_s: float = 0.2  # how often the launcher collects its ranks' output and states
    log_dir: str = "ray"  # inside each job's directory: every attempt's rank logs, error records and placement


@dataclass
class KubernetesLauncherConf:
    """Each job of a sweep becomes one Kubeflow Trainer TrainJob: its nodes run trainflow's worker under torchrun."""

    _target_: str = f"{PACKAGE}.kubernetes_launcher.KubernetesLauncher"
    image: str | None = None  # a container image with this trainflow (and its Python) installed: required
    namespace: str = "default"
    runtime: str = "torch-distributed"  # the training runtime the TrainJobs refer to (Trainer's torch runtime)
    runtime_kind: str = "ClusterTrainingRuntime"  # or TrainingRuntime (one in the job's namespace)
    nodes: int = 1  # numNodes of each TrainJob
    # ranks per node of a Hydra app other than trainflow (a trainflow job runs its parallelism.nproc_per_node); null: 1
    nproc_per_node: int | None = None
    # torchrun's restarts of a node's ranks after one fails, for an app other than trainflow (a trainflow job:
    # parallelism.max_restarts); null: 0
    max_restarts: int | None = None
    cpu_per_node: str | None = None  # resourcesPerNode: Kubernetes quantities ("8", "500m"); null: the runtime's
    memory_per_node: str | None = None  # e.g. "32Gi"
    gpus_per_node: int = 0  # nvidia.com/gpu per node
    # the PersistentVolumeClaim every node mounts at the sweep folder's own path (so the job's directory, its
    # checkpoints and outputs are where the composed config says): required
    volume_claim: str | None = None
    volume_sub_path: str | None = None  # the folder of the claim that holds this sweep; null: the sweep folder's name
    kubeconfig: str | None = None  # null: KUBECONFIG or ~/.kube/config, else the pod's own service account
    poll_interval_s: float = 5.0  # how often the launcher looks at its TrainJobs and their logs
    dry_run: bool = False  # write each job's TrainJob and ConfigMap to <sweep dir>/kubernetes/; submit nothing


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(group="hydra/launcher", name="process", node=ProcessLauncherConf, provider="trainflow")
    cs.store(group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="trainflow")
    cs.store(group="hydra/launcher", name="slurm", node=SlurmLauncherConf, provider="trainflow")
    cs.store(group="hydra/launcher", name="ray", node=RayLauncherConf, provider="trainflow")
    cs.store(group="hydra/launcher", name="kubernetes", node=KubernetesLauncherConf, provider="trainflow")
