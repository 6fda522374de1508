"""Typed configuration: the schema Hydra checks every composed run against, and the typed config the run reads.

Each config group option's YAML starts from one of these dataclasses (registered in Hydra's ConfigStore), so an
unknown key, a wrong type or a value outside a closed choice (trainflow.config.choices) is refused by Hydra with the
key's full name before any work starts. The model, data, task and optim schemas are open to keys they lack (a
user's `_target_` takes its own); trainflow.config.sections settles which keys each `_target_` is called with.
`typed_run` types the composed config once; the run reads that, never the DictConfig: a section of your code as
its section type (ModelSection, DataSection, ...), trainflow's keys as its fields and the keys its `_target_` is
called with in `kwargs`. Value checks a type cannot express (positive steps, combinations of groups) live in
trainflow.config.checks.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any, TypeVar, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from trainflow.config.choices import (
    STOP_SIGNALS,
    ActivationCheckpointing,
    Auto,
    Backend,
    CheckpointLoad,
    CheckpointMode,
    CompileMode,
    CompileScope,
    Device,
    Direction,
    FaultTolerance,
    FileFormat,
    Fp8Recipe,
    FSDPDtype,
    FSDPWrap,
    Items,
    LadderRung,
    NonFinite,
    NoQuorum,
    OnDataChange,
    PipelineSchedule,
    Precision,
    Progress,
    Schedule,
    StopSignal,
    Strategy,
    TaskKind,
    TokenizerKind,
    TrainMetrics,
    WandbMode,
    refused_choice,
    schema_node,
)
from trainflow.errors import ConfigError, UnknownKeyError, typed_command
from trainflow.models.cnn import CNN
from trainflow.models.gpt import GPT
from trainflow.models.mlp import MLP
from trainflow.util.targets import first_line

Schema = TypeVar("Schema")
Called = TypeVar("Called", bound="CalledSection")


@dataclass
class TrainerConfig:
    """The `trainer` section: the training loop's own knobs (steps, batch, seed, device, precision, logging)."""

    max_steps: int = 100
    batch_size: int = 16  # per rank, per micro-step
    grad_accum: int = 1
    seed: int = 1234
    device: Device = Device.auto  # auto: cuda when a GPU is visible, else cpu
    precision: Precision = Precision.fp32  # bf16: autocast; fp8: torchao float8 matmuls, bf16 elsewhere (GPUs sm 8.9+)
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise  # fp8: tensorwise (float8 all-gather under FSDP); rowwise: finer
    tf32: bool = True  # CUDA: fp32 matmuls and convolutions on TF32 tensor cores; false: full fp32 arithmetic
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured)
    log_every: int = 10
    eval_every: int | Auto = Auto.auto  # steps between evaluations; 0: only at the end; auto: see eval_interval
    eval_steps: int = 10
    excluded_steps: int = 5  # the first steps, left out of the steady-state figures (compiling steps come on top)
    deterministic: bool = False
    progress: Progress = Progress.auto  # auto: a bar when stdout is a terminal, else log lines
    print_config: bool = False  # the full config on the console too (it is always in config.yaml and train.log)
    # stop: at the next sync point, before any save; skip_step: skip the update (one host sync a step)
    nonfinite: NonFinite = NonFinite.stop
    run_name: str | None = None  # checkpointed runs live in outputs/runs/<run_name>; null: made from the overrides
    sweep_name: str | None = None  # -m sweeps live in multirun/<sweep_name>; null: made from the overrides
    cost_per_hour: float | None = None  # the price of one device (rank) for an hour: the summary's cost figures

    def eval_interval(self) -> int:
        """auto: 10 evaluations (a validation curve) in runs of 100 steps or more; shorter runs once, at the end."""
        if self.eval_every == Auto.auto:
            return self.max_steps // 10 if self.max_steps >= 100 else 0
        return self.eval_every


@dataclass
class MetricsConfig:
    peak_flops: float | None = None  # FLOP/s per device; overrides the measured/known peak
    # where each finished run appends its line (trainflow.record.ledger): auto (outputs/ledger.jsonl under the working
    # folder for runs inside it, else a sweep folder's own) | off | a file (one ledger for runs anywhere, many machines)
    ledger: str = "auto"


def model_schema(model: type) -> type:
    """A built-in model option's schema, made from the model's constructor: its defaults are written once, there."""
    hints = get_type_hints(model.__init__)
    own = [(name, hints[name], field(default=p.default)) for name, p in inspect.signature(model).parameters.items()]
    target = ("_target_", str, field(default=f"{model.__module__}.{model.__qualname__}"))
    return make_dataclass(f"{model.__name__}Config", [target, *own])


GPTConfig = model_schema(GPT)
CNNConfig = model_schema(CNN)
MLPConfig = model_schema(MLP)


@dataclass
class WorkerConfig:
    """How batches are loaded: trainflow's keys of every data section (a data._target_ is not given them)."""

    num_workers: int = 0
    pin_memory: bool | None = None  # null: pinned on CUDA (asynchronous copies), off on CPU
    persistent_workers: bool = False
    prefetch_factor: int | None = None


# trainflow's keys of every data section: they configure the loaders and are not passed to a data._target_
LOADER_KEYS = (*WorkerConfig.__dataclass_fields__, "seq_lens", "collate_fn")


@dataclass
class LoaderConfig(WorkerConfig):
    seq_len: int = 128  # tokens per sample for language models; defaults to the model's block_size
    seq_lens: list[int] | None = None  # language models: micro-batch k is cut to seq_lens[k % n] tokens (shapes vary)


@dataclass
class TextDataConfig(LoaderConfig):
    """data=text: text files tokenized once into a cache, cut into windows (trainflow.data.text_data)."""

    _target_: str = "trainflow.data.text_data"
    paths: list[str] | None = None  # files or folders; None: the Python standard library's source
    suffixes: list[str] = field(default_factory=lambda: [".py"])  # file endings read from folders
    val_fraction: float = 0.05
    cache_dir: str = "~/.cache/trainflow/tokens"
    tokenizer: Any = None  # the run's tokenizer section (${tokenizer} in conf/data/text.yaml); null: bytes
    model_vocab_size: int | None = None  # the model's vocabulary, checked against the tokenizer's


@dataclass
class ShardsDataConfig(LoaderConfig):
    """data=shards: token shards prepared once by `trainflow prepare`, read by memory map."""

    _target_: str = "trainflow.data.shards_data"
    path: str | None = None  # the folder `trainflow prepare --out` wrote (manifest.json and shard_NNNNN.bin)
    val_fraction: float = 0.05  # the last this fraction of the windows is held out
    model_vocab_size: int | None = None  # the model's vocabulary, checked against the shards' tokenizer


@dataclass
class TokenizerConfig:
    kind: TokenizerKind = TokenizerKind.bytes  # bytes: a token is a byte; bpe: byte-level BPE trained here; file: yours
    vocab_size: int = 256  # bytes: 256; bpe: the vocabulary to train; file: the file's (the model's follows it)
    path: str | None = None  # file: a tokenizer.json written by the tokenizers library
    min_frequency: int = 2  # bpe: pairs seen fewer times are never merged
    train_bytes: int = 100_000_000  # bpe: trained on the first this many bytes of the training text (time, memory)
    cache_dir: str = "~/.cache/trainflow/tokenizers"  # bpe: trained tokenizers, one per corpus and settings


@dataclass
class HFDataConfig(LoaderConfig):
    """data=hf: local files read by the datasets library, tokenized once, cut into windows."""

    _target_: str = "trainflow.data.hf.token_windows"
    paths: list[str] | None = None  # json, jsonl, csv, parquet or text files (or globs) of the training split
    column: str = "text"  # the column holding the text
    format: FileFormat | None = None  # null: from the files' suffix
    val_paths: list[str] | None = None  # the validation split's files; null: the last val_fraction of the tokens
    val_fraction: float = 0.05
    items: Items = Items.tuple  # tuple: (inputs, next-token targets); dict: {input_ids, labels} (the model shifts)
    cache_dir: str = "~/.cache/trainflow/hf"  # datasets' cache and the token caches
    tokenizer: Any = None  # the run's tokenizer section (${tokenizer} in conf/data/hf.yaml)
    model_vocab_size: int | None = None  # the model's vocabulary, checked against the tokenizer's


@dataclass
class SyntheticDataConfig(LoaderConfig):
    """data=synthetic: random tokens for a language model, else features labelled by a random teacher."""

    _target_: str = "trainflow.data.synthetic_data"
    num_samples: int = 65536  # size of one epoch
    data_seed: int = 0  # the task (teacher weights) is fixed by this seed, not by trainer.seed
    vocab_size: int | None = None  # the model's vocabulary: random tokens of it; null: features and labels
    in_features: int | None = None  # the features' width (null: the MLP's default)
    out_features: int | None = None  # the classes (null: the MLP's default)


@dataclass
class CustomDataConfig(WorkerConfig):
    """data=custom: your factory by `_target_` and the keys it takes, beside trainflow's loader keys."""

    _target_: str = MISSING


@dataclass
class DigitsDataConfig(WorkerConfig):
    """scikit-learn's handwritten digits (8x8 images, 10 classes), read through data._target_ as a user's data is."""

    _target_: str = "trainflow.data.digits.digits"
    val_fraction: float = 0.2
    split_seed: int = 0  # which images are held out


@dataclass
class TaskConfig:
    """trainflow's keys of every task section; a user's own task (task=custom) sets _target_ and adds its keys."""

    monitor: str = "loss"  # the validation metric train.py returns to sweepers
    mode: Direction = Direction.min  # the direction in which `monitor` improves
    # log_step: train/<metric> is the log step's batch (computing accuracy every step costs ~20% of a small
    # model's step); every_step: every step's, the log interval's mean. train/loss is always the interval's mean.
    train_metrics: TrainMetrics = TrainMetrics.log_step
    _target_: str | None = None  # a callable of (model, batch) -> (loss, {name: scalar tensor})


@dataclass
class BuiltinTaskConfig(TaskConfig):
    """task=auto, lm, classify: trainflow's tasks (trainflow.tasks)."""

    kind: TaskKind = TaskKind.auto  # auto: lm for language-model data, else classify
    top_k: int = 5  # classify: top-k accuracy too, when the model has more than k classes
    loss_from_model: bool = False  # lm: the model computes its own loss (model(**batch).loss)


@dataclass
class OptimConfig:
    """The `optim` section: the optimizer by `_target_` (a torch.optim class, or your own), called with the model's
    parameter groups and the section's keys, less trainflow's own (SCHEDULE_KEYS: the LR schedule it steps)."""

    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.1  # on weights (2-D and up); biases and norms form a group without it (0: one group)
    warmup_steps: int = 20  # linear lr warm-up
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at trainer.max_steps
    schedule: Schedule = Schedule.cosine


SCHEDULE_KEYS = ("warmup_steps", "min_lr_ratio", "schedule")  # trainflow's; the optimizer is not given them


@dataclass
class AdamWConfig(OptimConfig):
    """optim=adamw: torch.optim.AdamW (fused on CUDA)."""

    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class SGDConfig(OptimConfig):
    """optim=sgd: torch.optim.SGD with momentum."""

    _target_: str = "torch.optim.SGD"
    momentum: float = 0.9


@dataclass
class CompileConfig:
    enabled: bool = False
    backend: str = "inductor"  # a dynamo backend (inductor, aot_eager, eager, ...) or a dotted path to one
    mode: CompileMode | None = None  # inductor only; reduce-overhead: CUDA graphs
    fullgraph: bool = False  # true: the first graph break is an error naming the line
    dynamic: bool | None = None  # null: static, dynamic once a shape changes | true | false (a graph per shape)
    # model | blocks (each module of model.blocks, as FSDP wraps them) | null: follows the parallelism, blocks on
    # an FSDP-sharded model that has them (dynamo cannot trace into sharded blocks from the model's forward), else model
    scope: CompileScope | None = None
    cache_dir: str | None = "~/.cache/trainflow/inductor"  # persistent inductor cache; null: torch's default
    check: bool = False  # before training: compiled vs eager loss and gradients on one batch, same weights
    # dynamic=true on a run whose input shape never changed: at its end, a static compile timed against the dynamic one
    # (a second compile: asked for, not by default; the run's line says the shape never changed either way)
    measure_static: bool = False


@dataclass
class ProfilerConfig:
    enabled: bool = False
    skip_first: int | None = None  # steps before the first cycle; null: the run's warm-up + compile steps
    wait: int = 5  # idle steps at the start of each cycle
    warmup: int = 2  # traced but discarded steps (the profiler's own warm-up)
    active: int = 3  # recorded steps per window
    repeat: int = 1  # windows; 0: cycle until the run ends
    ranks: Any = field(default_factory=lambda: [0])  # which ranks profile: a list, or "all"
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    gzip: bool = False  # traces as .pt.trace.json.gz
    row_limit: int = 20  # rows of the ops table profile/ops_rank<r>.txt
    memory_snapshot: bool = False  # CUDA allocator history + snapshot for pytorch.org/memory_viz
    memory_history_entries: int = 100_000  # allocator events kept for the snapshot

    def window(self, excluded_steps: int) -> tuple[int, int]:
        """Steps skipped before the first cycle, and the step (counted from the run's start) the last window ends;
        `excluded_steps` stand for a skip_first of null."""
        skip = excluded_steps if self.skip_first is None else self.skip_first
        return skip, skip + (self.wait + self.warmup + self.active) * max(self.repeat, 1)


@dataclass
class DDPConfig:
    bucket_cap_mb: float = 25.0  # gradients are all-reduced in buckets of this size, overlapping backward
    find_unused_parameters: bool = False  # needed only when some parameters get no gradient in a step
    static_graph: bool = False  # the same parameters are used every step: lets DDP skip per-step searches
    gradient_as_bucket_view: bool = False  # gradients alias the buckets: saves one copy of the gradients


@dataclass
class FSDPConfig:
    reshard_after_forward: bool = True  # free gathered parameters after forward (memory) or keep them (speed)
    param_dtype: FSDPDtype | None = None  # null: bf16 under trainer.precision=bf16, else as stored
    reduce_dtype: FSDPDtype | None = None  # the gradient reduce-scatter's; null: fp32
    wrap: FSDPWrap = FSDPWrap.auto  # auto: blocks if the model has `blocks`, else size
    min_params: int = 1_000_000  # size wrapping: shard each submodule holding at least this many parameters
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in CPU memory


@dataclass
class HSDPConfig:
    shard_size: int | None = None  # ranks one copy of the model is sharded over; null: the ranks of one node
    replicate_size: int | None = None  # copies of the sharded model; null: world size / shard_size (the nodes)


@dataclass
class WatchdogConfig:
    enabled: bool | Auto = Auto.auto  # hang reports in <run dir>/hang/; auto: in runs of 2+ ranks
    factor: float = 20.0  # a rank with no step for this many median step times is reported stuck
    min_s: float = 60.0  # never sooner (keep it below parallelism.timeout_s, which ends the run)


@dataclass
class StragglerConfig:
    # a rank whose own time per step (step time less its wait in the gradient sync) is this many times the median
    # of the other ranks' is a straggler; named once, with its host, after `intervals` log intervals in a row
    factor: float = 1.5
    intervals: int = 3


@dataclass
class FaultToleranceConfig:
    """parallelism.fault_tolerance=torchft: replica groups that train on when one is lost (docs/scale.md)."""

    replica_groups: int = 2  # jobs, each a trainflow run of its own, that average their gradients
    replica_id: int = 0  # this job's group, 0 .. replica_groups - 1 (and its share of the sample stream)
    # a running lighthouse (http://host:29510: `trainflow lighthouse` or torchft_lighthouse); auto: on the groups' host,
    # in a process of its own that the first group to find none starts and that outlives any one group
    lighthouse: str = "auto"
    lighthouse_port: int = 29510  # where lighthouse=auto listens (every group looks for it on localhost)
    lighthouse_idle_s: float = 60.0  # lighthouse=auto: it ends once no group has talked to it this long
    min_replicas: int = 1  # the fewest groups a step trains with
    timeout_s: float = 30.0  # a quorum, a collective with a lost group, the fetch of a peer's state
    # what a group does when no quorum comes within timeout_s (the lighthouse is lost, or fewer than min_replicas
    # groups reach it): stop (with its checkpoint committed, exit 75: the same command resumes) | alone (train on as
    # a plain run, no longer synchronised with the other groups)
    no_quorum: NoQuorum = NoQuorum.stop
    heartbeat_timeout_s: float = 5.0  # lighthouse=auto: a group silent this long is left out of the next quorum
    join_timeout_s: float = 10.0  # lighthouse=auto: how long a quorum waits for a live group that has not asked


@dataclass
class ParallelismConfig:
    strategy: Strategy = Strategy.single  # hsdp: shard within a node, replicate across; auto: from measured memory
    # degrees of the mesh (trainflow.distributed.mesh), their product the world size; -1: the rest of the world;
    # null: the strategy's rule (ddp replicates over every data-parallel rank, fsdp shards, hsdp both)
    dp_replicate: int | None = None
    dp_shard: int | None = None
    tp: int = 1  # tensor parallel: ranks each layer is split over (within a node; the mesh's last dimension)
    tp_plan: Any = None  # a _target_ returning the model's TP plan ({module name: ParallelStyle}); null: the model's
    # processes on this node; auto: one per GPU (without GPUs 2 for ddp/fsdp/hsdp, else 1); the launchers follow it
    nproc_per_node: int | Auto = 1
    backend: Backend = Backend.auto  # auto: nccl on CUDA, gloo on CPU
    global_batch: int | None = None  # when set, trainer.batch_size = global_batch / (world size * grad_accum)
    # full: recompute each block's activations in backward; selective: keep the matmul and attention outputs, recompute
    # the cheap ops; budget: compile's partitioner keeps what fits activation_budget
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.off
    activation_checkpointing_every: int = 1  # full and selective: checkpoint every N-th block (1: every block)
    activation_budget: float = 0.5  # budget: the share of compile's saved activations kept (0: recompute all)
    pp: int = 1  # pipeline parallel: stages of model.blocks over this many ranks (the mesh's outermost dimension)
    pp_schedule: PipelineSchedule = PipelineSchedule["1f1b"]  # the last 3 of its choices: 2 stages a rank
    microbatches: int | None = None  # pipeline micro-batches per trainer.batch_size; null: one per pipeline stage
    max_restarts: int = 0  # self-launched runs: how often the elastic agent restarts failed workers
    timeout_s: float = 300.0  # how long a collective may wait for the other ranks
    check: bool = False  # parity check: train a single-process reference on rank 0 alongside and compare
    check_steps: int = 3  # steps after which parameters are compared
    check_tolerance: float | None = None  # largest relative difference that passes; null: by trainer.precision
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # also the sharding options of hsdp
    hsdp: HSDPConfig = field(default_factory=HSDPConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)  # runs of 2+ ranks, at log steps
    memory_budget_gb: float | None = None  # auto: memory one rank may use; null: free memory x memory_headroom
    memory_headroom: float = 0.8  # auto: the share of the free memory a plan may fill
    # torchft (pip install 'trainflow[ft]'): train on through a lost replica group
    fault_tolerance: FaultTolerance = FaultTolerance.off
    # the settings of parallelism.fault_tolerance=torchft; a run without it carries none (null in its config.yaml)
    ft: FaultToleranceConfig | None = field(default_factory=FaultToleranceConfig)


@dataclass
class CheckpointConfig:
    enabled: bool = False
    mode: CheckpointMode = CheckpointMode.sync  # sync: dcp.save; async: dcp.async_save (the loop waits for staging)
    dir: str | None = None  # null: <run dir>/checkpoints; an earlier run's directory continues its checkpoints
    every_steps: int = 100
    keep_last: int = 3  # committed checkpoints kept; the newest and the one resumed from are never deleted
    resume: str = "auto"  # auto (newest committed in dir) | never | a path (step_N, a checkpoint dir, a run dir)
    save_final: bool = True  # save at the last step too
    verify: bool = True  # reload the run's first save into fresh tensors and compare exactly
    export: bool = False  # at the end, <run dir>/model.pt: model weights for torch.load(weights_only=True)
    load: CheckpointLoad = CheckpointLoad.all  # model: weights only from checkpoint.resume=<path>: fresh optimizer
    # a resume on other data than the checkpoint's (files added, other shards, another split); restart: go on from
    # the checkpoint on this data, the data position restarted at sample 0
    on_data_change: OnDataChange = OnDataChange.refuse
    stop_signals: list[StopSignal] = field(default_factory=lambda: list(STOP_SIGNALS))  # signals that save, then stop


@dataclass
class TensorBoardLoggerConfig:
    """logger=tensorboard: event files in <run dir>/tensorboard (a sweep job: tensorboard/<swept values>)."""

    _target_: str = "trainflow.loggers.tensorboard.TensorBoardLogger"
    flush_secs: int = 10  # a running run shows within seconds


@dataclass
class MLflowLoggerConfig:
    """logger=mlflow (`pip install 'trainflow[mlflow]'`): params, metrics, tags, artifacts, status of one run."""

    _target_: str = "trainflow.loggers.mlflow.MLflowLogger"
    tracking_uri: str | None = None  # null: sqlite:///<working dir>/outputs/mlflow.db (no server); or http://host:port
    experiment: str = "trainflow"
    tags: dict[str, str] = field(default_factory=dict)  # added to the run's own (run name, run dir, host, ...)
    flush_s: float = 5.0  # metrics are sent at most this often (a store's cost is per call): the UI lags by as much


@dataclass
class WandbLoggerConfig:
    """logger=wandb (`pip install 'trainflow[wandb]'`): config, scalars, summary, files and exit code of one run."""

    _target_: str = "trainflow.loggers.wandb.WandbLogger"
    project: str = "trainflow"
    entity: str | None = None  # null: the API key's default entity
    group: str | None = None  # null: a sweep job's sweep name (single runs: none)
    tags: list[str] = field(default_factory=list)
    notes: str | None = None
    mode: WandbMode | None = None  # null: WANDB_MODE, else online with an API key, offline without
    dir: str | None = None  # null: WANDB_DIR, else the run directory (W&B writes <dir>/wandb/)


# The built-in loggers' schemas, by their key under `logger`; a user's logger (its own `_target_`) is open.
LOGGER_SCHEMAS: dict[str, type] = {"tensorboard": TensorBoardLoggerConfig, "mlflow": MLflowLoggerConfig,
                                   "wandb": WandbLoggerConfig}


@dataclass
class LadderConfig:
    """experiment=ladder: which rung a job is, and what its gates accept (trainflow.report.ladder evaluates them)."""

    rung: LadderRung | None = None  # set by the ladder/ options; null: not a ladder job
    loss_rtol: float | None = None  # largest relative loss difference to the baseline at any step; null: by precision
    resume_atol: float = 0.0  # largest |resumed - uninterrupted| loss at any step; 0: bit-identical
    fp8_rtol: float | None = None  # largest relative loss difference of the fp8 rung to bf16's; null: 0.1
    # trainer.log_every of every rung; null: ~10 logs a run, at a divisor of the half-way step where the resume rung
    # starts (each log is a host sync; the gates compare the logged interval means of the rungs step by step)
    log_every: int | None = None


@dataclass
class CalledSection:
    """A section of your code past `check_config`: its `_target_` and `kwargs`, the keyword arguments the target is
    called with (trainflow.config.sections settles which). trainflow's own keys of the section are fields of its
    type, typed, and never in `kwargs`."""

    _target_: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    # the section's keys as composed, in order: `plain` writes the section back as it was given (config.yaml)
    keys: list[str] = field(default_factory=list)


@dataclass
class ModelSection(CalledSection):
    """The `model` section: the class and its arguments. What trainflow reads of a built-in model's arguments (its
    vocabulary, context, heads, width, dropout) it reads here; None where the model takes no such argument."""

    @property
    def vocab_size(self) -> int | None:
        """A language model's vocabulary (the model takes vocab_size); None for others."""
        return self.kwargs.get("vocab_size")

    @property
    def block_size(self) -> int | None:
        return self.kwargs.get("block_size")

    @property
    def n_head(self) -> int | None:
        return self.kwargs.get("n_head")

    @property
    def n_embd(self) -> int | None:
        return self.kwargs.get("n_embd")

    @property
    def dropout(self) -> float | None:
        return self.kwargs.get("dropout")


@dataclass
class DataSection(CalledSection, WorkerConfig):
    """The `data` section: the factory and its arguments, beside the loader's keys (trainflow's: LOADER_KEYS)."""

    seq_lens: list[int] | None = None  # language models: micro-batch k is cut to seq_lens[k % n] tokens
    collate_fn: Any = None  # a section with its own _target_: how a user's items become a batch

    @property
    def seq_len(self) -> int | None:
        """The tokens per sample the factory is given (its seq_len argument); None when it takes none."""
        return self.kwargs.get("seq_len")


@dataclass
class TaskSection(CalledSection, BuiltinTaskConfig):
    """The `task` section: trainflow's task (no `_target_`) with its keys, or yours with the keys it is bound to."""


@dataclass
class OptimSection(CalledSection, OptimConfig):
    """The `optim` section: lr and weight decay (set per parameter group) and the schedule's keys are trainflow's;
    `kwargs` holds the optimizer's other arguments (betas, momentum, yours)."""


@dataclass
class StageSection(CalledSection):
    """A `stages.<name>` section: the stage class, its arguments, and the assembly's order keys."""

    before: Any = None  # a stage's name or a list of them: this stage runs before those
    after: Any = None

    def order(self) -> dict[str, Any]:
        """The order keys the section gives (a null one too: it clears the class's own order), by key."""
        return {key: getattr(self, key) for key in ORDER_KEYS if key in self.keys}


ORDER_KEYS = ("before", "after")  # the assembly's keys of a stage's section (StageSection), never given to its class
# The sections of your code, by name, as the run reads them; `logger` and `stages` hold one such section per name.
CALLED_SECTIONS: dict[str, type[CalledSection]] = {"model": ModelSection, "data": DataSection, "task": TaskSection,
                                                   "optim": OptimSection}


@dataclass
class RunConfig:
    """Everything one run is composed of: one section per config group (`trainer` holds the loop's own knobs).

    The sections of your code (model, data, task, optim, logger, stages) are open to the keys your `_target_` takes:
    Hydra composes them as plain keys (RunSchema); the typed config the run reads (`typed_run`) holds each as its
    section type, your keys in its `kwargs`."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    task: TaskSection = field(default_factory=TaskSection)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimSection = field(default_factory=OptimSection)  # its own keys (optim=adamw, sgd) or yours (custom)
    compile: CompileConfig = field(default_factory=CompileConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # logger=[tensorboard,mlflow]: each chosen logger's keys under logger.<name>, its class by `_target_`
    logger: dict[str, CalledSection] = field(default_factory=dict)
    # stages=[early_stopping,ema] or +stages.mine._target_=...: each stage's keys under stages.<name>, its class by
    # `_target_` (trainflow.loop.configured)
    stages: dict[str, StageSection] = field(default_factory=dict)


@dataclass
class LadderRunConfig(RunConfig):
    """A job of experiment=ladder: a run and its rung (the only runs whose config holds a `ladder` section)."""

    ladder: LadderConfig = field(default_factory=LadderConfig)


def open_schema(schema: type) -> type:
    """`schema` as Hydra composes it: the sections of your code as plain keys (Any), the others typed."""
    opened = [("model", Any, field(default=MISSING)), ("data", Any, field(default=MISSING)),
              ("task", Any, field(default=MISSING)), ("optim", Any, field(default=MISSING)),
              ("logger", Any, field(default_factory=dict)), ("stages", Any, field(default_factory=dict))]
    return make_dataclass(schema.__name__.replace("Config", "Schema"), opened, bases=(schema,))


RunSchema = open_schema(RunConfig)
LadderRunSchema = open_schema(LadderRunConfig)


def typed(values: Mapping[str, Any], schema: type[Schema], section: str) -> Schema:
    """Plain values of the config `section` (resolved, or read back from a run's saved config) as its schema's
    dataclass; nested sections (parallelism.fsdp) become their dataclasses too, the schema's defaults fill what the
    values leave out, and a key or value the schema refuses is one line naming it."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema_node(schema), values))
    except ValidationError as exc:
        raise ConfigError(refused_choice(exc, section) or f"{section}.{exc.full_key}: {first_line(exc)}") from None
    except ConfigKeyError as exc:  # a key added with Hydra's `+` that the section does not have
        key = str(exc.full_key or exc.key)
        parent, _, leaf = key.rpartition(".")
        close = difflib.get_close_matches(leaf, list(schema.__dataclass_fields__), n=1)
        hint = f"did you mean {section}.{parent + '.' if parent else ''}{close[0]}?" if close \
            else f"{typed_command()} --cfg job lists every key"
        raise UnknownKeyError(f"{section}.{key}: {section} has no such key; {hint}") from None


# The keys of each section of your code that are trainflow's (typed as its section type's fields), never given to
# its `_target_`: the loader's, the task's, the schedule's and the parameter groups'. The model has none.
OWN_KEYS: dict[str, tuple[str, ...]] = {
    "model": (), "data": LOADER_KEYS, "task": tuple(BuiltinTaskConfig.__dataclass_fields__),
    "optim": (*SCHEDULE_KEYS, "lr", "weight_decay"), "stages": ORDER_KEYS}
# trainflow's keys each such section always has in the typed config (their schema's defaults where not given)
DEFAULTED_KEYS = {name: tuple(k for k in schema.__dataclass_fields__ if k != "_target_")
                  for name, schema in (("data", WorkerConfig), ("task", TaskConfig), ("optim", OptimConfig))}


def typed_run(values: Mapping[str, Any]) -> RunConfig:
    """The composed config, resolved, as the run reads it: each section as its dataclass; a section of your code
    as its section type, trainflow's keys in it typed (with their defaults, for an option file of one's own that
    has no schema) and the keys its `_target_` is called with in `kwargs`. Fault tolerance's settings go only into
    a run that uses it."""
    schema = LadderRunConfig if "ladder" in values else RunConfig
    hints = get_type_hints(schema)
    parallelism = values.get("parallelism") or {}
    if parallelism.get("fault_tolerance", FaultTolerance.off) == FaultTolerance.off:
        values = {**values, "parallelism": {**parallelism, "ft": None}}
    called: dict[str, Any] = {name: typed_section(name, values.get(name) or {}) for name in CALLED_SECTIONS}
    called.update({name: named_sections(name, values.get(name) or {}) for name in ("logger", "stages")})
    return schema(**called, **{f.name: typed(values.get(f.name) or {}, hints[f.name], f.name)
                               for f in fields(schema) if f.name not in called})


def typed_section(name: str, section: Mapping[str, Any]) -> CalledSection:
    """The section `name` of your code (model, data, task, optim) as the run reads it (`called_section`)."""
    return called_section(section, CALLED_SECTIONS[name], name)


def named_sections(name: str, sections: Mapping[str, Any]) -> dict[str, CalledSection]:
    """`logger` or `stages`: each named section (logger.mlflow, stages.ema) as its section type."""
    schema = StageSection if name == "stages" else CalledSection
    return {str(key): called_section(keys or {}, schema, f"{name}.{key}") for key, keys in sections.items()}


def called_section(section: Mapping[str, Any], schema: type[Called], name: str) -> Called:
    """`section` (the keys its `_target_` is called with, as trainflow.config.sections settled them, beside
    trainflow's own) as its section type `schema`: trainflow's keys typed, the others in `kwargs`."""
    group = name.split(".")[0]
    own = set(OWN_KEYS.get(group, ()))
    given = {k: v for k, v in section.items() if k in own and k != "collate_fn"}  # a collate's keys: yours, as given
    made = typed({**given, "_target_": section.get("_target_")}, schema, name)
    kwargs = {k: v for k, v in section.items() if k not in own and k != "_target_"}
    keys = [*section, *(k for k in DEFAULTED_KEYS.get(group, ()) if k not in section)]
    extra = {"collate_fn": section.get("collate_fn")} if schema is DataSection else {}
    return replace(made, kwargs=kwargs, keys=[str(k) for k in keys], **extra)


def plain(cfg: RunConfig) -> dict[str, Any]:
    """The run's config as plain values (choices as the words they are typed as): config.yaml, summary.json. A
    section of your code is written back as it was given: its keys, trainflow's and yours, in their order."""
    values = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    for name in CALLED_SECTIONS:
        values[name] = _as_given(values[name])
    for name in ("logger", "stages"):
        values[name] = {key: _as_given(section) for key, section in values[name].items()}
    return values


def _as_given(section: dict[str, Any]) -> dict[str, Any]:
    kwargs, keys = section.pop("kwargs"), section.pop("keys")
    every = {**section, **kwargs}
    return {k: every[k] for k in keys}


def register_configs() -> None:
    """Put the schemas where the YAML defaults lists can find them."""
    cs = ConfigStore.instance()
    cs.store(group="schema/run", name="train", node=schema_node(RunSchema))  # experiment=ladder picks "ladder"
    cs.store(group="schema/run", name="ladder", node=schema_node(LadderRunSchema))
    # Options whose keys differ (model and data kinds) extend these; the other groups are typed by RunConfig.
    # Open: a key the schema lacks composes, so that a user's _target_ and its keys on a built-in option reach
    # trainflow.config.sections (which drops the option's keys the target does not take, and refuses yours that it
    # does not take).
    for group, name, schema in (("model", "gpt", GPTConfig), ("model", "mlp", MLPConfig), ("model", "cnn", CNNConfig),
                                ("data", "text", TextDataConfig), ("data", "synthetic", SyntheticDataConfig),
                                ("data", "digits", DigitsDataConfig), ("data", "hf", HFDataConfig),
                                ("data", "shards", ShardsDataConfig),
                                ("task", "builtin", BuiltinTaskConfig), ("optim", "adamw", AdamWConfig),
                                ("optim", "sgd", SGDConfig)):
        cs.store(group=f"schema/{group}", name=name, node=opened(OmegaConf.structured(schema)))
    # model=custom, data=custom, task=custom, optim=custom: your _target_ and keys, beside trainflow's own (typed)
    cs.store(group="schema/model", name="open", node=opened(OmegaConf.create({"_target_": MISSING})))
    for group, schema in (("data", CustomDataConfig), ("task", TaskConfig), ("optim", OptimConfig)):
        yours = OmegaConf.structured(schema)
        yours._target_ = MISSING
        cs.store(group=f"schema/{group}", name="open", node=opened(yours))
    for name, schema in LOGGER_SCHEMAS.items():  # closed: a misspelt logger.mlflow.* key is Hydra's one line
        cs.store(group="schema/logger", name=name, node=schema)


def opened(section: DictConfig) -> DictConfig:
    """`section` taking keys it does not declare without Hydra's `+` (Hydra closes the rest of the config)."""
    OmegaConf.set_struct(section, False)
    return section


