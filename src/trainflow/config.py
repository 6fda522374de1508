"""Typed configuration: the schema Hydra checks every composed run against.

Each config group option's YAML starts from one of these dataclasses (registered
in Hydra's ConfigStore), so an unknown key or a wrong type is rejected by Hydra
with the key's full name before any work starts. Value checks that a type cannot
express (positive steps, known choices) live in `validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from trainflow.errors import ConfigError


@dataclass
class TrainerConfig:
    max_steps: int = 100
    batch_size: int = 16  # per rank, per micro-step
    grad_accum: int = 1
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured)
    log_every: int = 10
    eval_every: int = 50  # 0: only at the end
    eval_steps: int = 10
    warmup_steps: int = 5  # excluded from steady-state figures
    deterministic: bool = False
    progress: str = "auto"  # auto (bar when stdout is a terminal) | bar | log


@dataclass
class MetricsConfig:
    peak_flops: float | None = None  # FLOP/s per device; overrides the measured/known peak


@dataclass
class GPTConfig:
    _target_: str = "trainflow.models.gpt.GPT"
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = True


@dataclass
class MLPConfig:
    _target_: str = "trainflow.models.mlp.MLP"
    in_features: int = 100
    hidden: int = 256
    out_features: int = 10


@dataclass
class LoaderConfig:
    seq_len: int = 128  # tokens per sample for language models; defaults to the model's block_size
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None


@dataclass
class TextDataConfig(LoaderConfig):
    kind: str = "text"
    paths: list[str] | None = None  # files or folders; None: the Python standard library's source
    suffixes: list[str] = field(default_factory=lambda: [".py"])  # file endings read from folders
    val_fraction: float = 0.05
    cache_dir: str = "~/.cache/trainflow/tokens"


@dataclass
class SyntheticDataConfig(LoaderConfig):
    kind: str = "synthetic"
    num_samples: int = 65536  # size of one epoch
    data_seed: int = 0  # the task (teacher weights) is fixed by this seed, not by trainer.seed


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9  # sgd only
    warmup_steps: int = 20  # linear lr warm-up
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at trainer.max_steps
    schedule: str = "cosine"  # cosine | constant


@dataclass
class CompileConfig:
    enabled: bool = False
    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    scope: str = "model"  # model | blocks
    cache_dir: str | None = None
    check: bool = False


@dataclass
class ProfilerConfig:
    enabled: bool = False


@dataclass
class ParallelismConfig:
    strategy: str = "single"  # single | ddp | fsdp
    nproc_per_node: Any = 1  # int or "auto"
    backend: str = "auto"


@dataclass
class CheckpointConfig:
    enabled: bool = False


@dataclass
class LoggerConfig:
    tensorboard: bool = True


@dataclass
class TrainConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    model: Any = MISSING
    data: Any = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def register_configs() -> None:
    """Put the schemas where the YAML defaults lists can find them."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="gpt_schema", node=GPTConfig)
    cs.store(group="model", name="mlp_schema", node=MLPConfig)
    cs.store(group="data", name="text_schema", node=TextDataConfig)
    cs.store(group="data", name="synthetic_schema", node=SyntheticDataConfig)
    cs.store(group="optim", name="schema", node=OptimConfig)
    cs.store(group="compile", name="schema", node=CompileConfig)
    cs.store(group="profiler", name="schema", node=ProfilerConfig)
    cs.store(group="parallelism", name="schema", node=ParallelismConfig)
    cs.store(group="checkpoint", name="schema", node=CheckpointConfig)
    cs.store(group="logger", name="schema", node=LoggerConfig)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _one_of(cfg: DictConfig, key: str, choices: tuple) -> None:
    value = cfg
    for part in key.split("."):
        value = value[part]
    _require(value in choices, key, f"must be one of {', '.join(map(str, choices))}; got {value!r}")


def validate(cfg: DictConfig) -> None:
    """Check the values a type cannot; raise ConfigError naming the key and the fix."""
    t = cfg.trainer
    for key in ("max_steps", "batch_size", "grad_accum", "log_every", "eval_steps"):
        _require(t[key] > 0, f"trainer.{key}", f"must be a positive integer; got {t[key]}")
    for key in ("eval_every", "warmup_steps"):
        _require(t[key] >= 0, f"trainer.{key}", f"must be >= 0; got {t[key]}")
    _require(t.grad_clip >= 0, "trainer.grad_clip", f"must be >= 0 (0 disables clipping); got {t.grad_clip}")
    _one_of(cfg, "trainer.device", ("auto", "cpu", "cuda"))
    _one_of(cfg, "trainer.precision", ("fp32", "bf16"))
    _one_of(cfg, "trainer.progress", ("auto", "bar", "log"))

    o = cfg.optim
    _one_of(cfg, "optim.name", ("adamw", "sgd"))
    _one_of(cfg, "optim.schedule", ("cosine", "constant"))
    _require(o.lr > 0, "optim.lr", f"must be > 0; got {o.lr}")
    _require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0; got {o.weight_decay}")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0; got {o.warmup_steps}")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1]; got {o.min_lr_ratio}")
    _require(len(o.betas) == 2, "optim.betas", f"must be two numbers, e.g. [0.9,0.95]; got {list(o.betas)}")

    _require("_target_" in cfg.model, "model._target_",
             "missing: pick model=gpt_tiny|gpt_small|gpt_medium|mlp or set model._target_ to an nn.Module class")
    d = cfg.data
    _require(d.get("kind") in ("text", "synthetic"), "data.kind",
             "unknown data source: pick data=text or data=synthetic")
    _require(d.num_workers >= 0, "data.num_workers", f"must be >= 0; got {d.num_workers}")
    if d.prefetch_factor is not None:
        _require(d.num_workers > 0, "data.prefetch_factor", "needs data.num_workers > 0 (or set it to null)")
        _require(d.prefetch_factor > 0, "data.prefetch_factor", f"must be > 0; got {d.prefetch_factor}")
    _require(not d.persistent_workers or d.num_workers > 0, "data.persistent_workers",
             "needs data.num_workers > 0 (or set it to false)")
    if d.kind == "text":
        _require(0 < d.val_fraction < 1, "data.val_fraction", f"must be in (0, 1); got {d.val_fraction}")
        if d.paths is not None:
            _require(len(d.paths) > 0, "data.paths",
                     "is empty: give files or folders, e.g. data.paths=[/path/to/corpus], or null for the default")
    else:
        _require(d.num_samples > 0, "data.num_samples", f"must be > 0; got {d.num_samples}")

    if cfg.metrics.peak_flops is not None:
        _require(cfg.metrics.peak_flops > 0, "metrics.peak_flops", f"must be > 0; got {cfg.metrics.peak_flops}")
