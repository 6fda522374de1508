"""Value checks a type cannot express (positive steps, combinations of groups), run once on the typed config before
any work starts: each failure is one line naming the key and the fix.

The schemas (trainflow.config.schema) say what keys exist, their types and the closed choices; this module says
which values make sense. `check_config` is the boundary: it takes the composed config and returns the typed one the run
reads.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from trainflow.config.choices import BYTE_VOCAB, Strategy
from trainflow.config.command_line import command_line_keys, single_run
from trainflow.config.schema import (
    LadderRunConfig,
    OptimSection,
    ParallelismConfig,
    RunConfig,
    TextDataConfig,
    typed_run,
)
from trainflow.config.sections import check_targets_given, settled_sections
from trainflow.errors import ConfigError
from trainflow.util.files import cannot_write
from trainflow.util.optional import torchft_installed
from trainflow.util.rundir import run_name_problem
from trainflow.util.targets import OPTIMIZER, import_target


def check_optimizer(optim: OptimSection) -> None:
    """optim._target_ imports as an optimizer class (whether it takes the section's keys: trainflow.config.sections)."""
    target = str(optim._target_)
    cls = import_target("optim._target_", target, OPTIMIZER)
    _require(inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer), "optim._target_",
             f"{target} is not a torch.optim.Optimizer class; give {OPTIMIZER}")


def check_optim(optim: OptimSection) -> None:
    """The schedule's and the optimizer's values a type cannot check (betas and momentum: the optimizer's own)."""
    _require(optim.lr > 0, "optim.lr", f"must be > 0; got {optim.lr}")
    _require(optim.weight_decay >= 0, "optim.weight_decay", f"must be >= 0; got {optim.weight_decay}")
    _require(optim.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0; got {optim.warmup_steps}")
    _require(0 <= optim.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1]; got {optim.min_lr_ratio}")
    arguments = optim.kwargs
    if "betas" in arguments:
        betas = list(arguments["betas"])
        _require(len(betas) == 2, "optim.betas", f"must be two numbers, e.g. [0.9,0.95]; got {betas}")
        _require(all(0 <= b < 1 for b in betas), "optim.betas", f"each must be in [0, 1), e.g. [0.9,0.95]; got {betas}")
    if "momentum" in arguments:
        _require(arguments["momentum"] >= 0, "optim.momentum", f"must be >= 0; got {arguments['momentum']}")
    check_optimizer(optim)


def check_task(cfg: RunConfig) -> None:
    """Task values a type cannot check; whether task.monitor exists is known once the task ran on a sample."""
    task = cfg.task
    if task._target_:
        return
    _require(task.top_k > 0, "task.top_k", f"must be a positive integer; got {task.top_k}")
    lm = task.kind == "lm" or (task.kind == "auto" and cfg.model.vocab_size is not None)
    _require(not task.loss_from_model or lm, "task.loss_from_model",
             "is for language models (task=lm); set it to false, or task.kind=lm")


def check_compile(cfg: RunConfig) -> None:
    """Compile values a type cannot check (the backend name is checked where dynamo is imported)."""
    data = cfg.data
    if data.seq_lens is not None:
        lens = list(data.seq_lens)
        _require(len(lens) > 0, "data.seq_lens", "is empty: give lengths, e.g. data.seq_lens=[32,64,128], or null")
        _require(cfg.model.vocab_size is not None, "data.seq_lens",
                 "varies sequence lengths, which needs a language model (model=gpt_*); set it to null")
        _require(all(0 < n <= data.seq_len for n in lens), "data.seq_lens",
                 f"each length must be in [1, data.seq_len={data.seq_len}]; got {lens}")
    compile_ = cfg.compile
    if not compile_.enabled:
        return
    _require(bool(compile_.backend), "compile.backend", "is empty: use inductor, aot_eager or eager")
    _require(compile_.mode is None or compile_.backend == "inductor", "compile.mode",
             f"only the inductor backend takes a mode; got compile.backend={compile_.backend}: "
             "set compile.mode=null or compile.backend=inductor")
    if compile_.mode == "reduce-overhead" or compile_.backend == "cudagraphs":
        key, value = (("compile.mode", compile_.mode) if compile_.mode == "reduce-overhead"
                      else ("compile.backend", compile_.backend))
        strategy = cfg.parallelism.strategy
        _require(strategy == Strategy.single, key,
                 f"{value} captures CUDA graphs, which break under parallelism={strategy} (open PyTorch issues: "
                 "cudagraph trees with DDP's hooks and FSDP's all-gathers); use "
                 "compile.mode=max-autotune-no-cudagraphs or compile=default")
        on_gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
        _require(on_gpu, key, f"{value} uses CUDA graphs, which need a GPU, and this run is on CPU: "
                 "use compile=default (inductor without CUDA graphs)")


def check_profiler(cfg: RunConfig) -> None:
    """Window and option checks; `ranks` against the world size happens in the Profiler, where it is known."""
    profiler = cfg.profiler
    if not profiler.enabled:
        return
    _require(profiler.active > 0, "profiler.active",
             f"must be a positive number of recorded steps; got {profiler.active}")
    for key in ("wait", "warmup", "repeat"):
        value = getattr(profiler, key)
        _require(value >= 0, f"profiler.{key}", f"must be >= 0; got {value}")
    if profiler.skip_first is not None:
        _require(profiler.skip_first >= 0, "profiler.skip_first",
                 f"must be >= 0, or null for the run's warm-up steps; got {profiler.skip_first}")
    # all, or a list of ranks: a Union of a word and a list, which OmegaConf does not type
    ranks = profiler.ranks
    valid = ranks == "all" or (isinstance(ranks, list) and len(ranks) > 0
                               and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks))
    _require(valid, "profiler.ranks", f"must be all or a non-empty list of ranks such as [0,1]; got {ranks!r}")
    if ranks != "all":
        _require(min(ranks) >= 0, "profiler.ranks", f"rank {min(ranks)} does not exist: ranks count from 0")
    _require(profiler.row_limit > 0, "profiler.row_limit", f"must be > 0; got {profiler.row_limit}")
    _require(profiler.memory_history_entries > 0, "profiler.memory_history_entries",
             f"must be > 0; got {profiler.memory_history_entries}")
    # A window past the end would profile nothing: refuse (compile steps are added at run time, in the Profiler).
    skip, end = profiler.window(cfg.trainer.excluded_steps)
    _require(end <= cfg.trainer.max_steps, "trainer.max_steps",
             f"is {cfg.trainer.max_steps} but the profiler window ends at step {end} (skip_first {skip} + "
             f"{max(profiler.repeat, 1)} x (wait {profiler.wait} + warmup {profiler.warmup} + "
             f"active {profiler.active})); raise "
             f"trainer.max_steps to >= {end} or shorten the window (profiler.skip_first/wait/warmup/active)")


def check_parallelism(cfg: RunConfig) -> None:
    """Checks that need no process group; world-size-dependent ones happen where the world size is known."""
    parallelism = cfg.parallelism
    for key in ("dp_replicate", "dp_shard", "tp"):
        value = getattr(parallelism, key)
        _require(value is None or value == -1 or value >= 1, f"parallelism.{key}",
                 f"must be a positive integer, -1 (the rest of the world){' or null' * (key != 'tp')}; got {value}")
    _require(parallelism.tp == 1 or parallelism.strategy != Strategy.auto, "parallelism.tp",
             f"is {parallelism.tp}, but parallelism=auto chooses the TP degree itself; to fix it, pick "
             "parallelism=fsdp, ddp or hsdp with parallelism.tp")
    check_tp_sizes(cfg)
    _require(parallelism.tp == 1 or parallelism.activation_checkpointing == "off" or not cfg.compile.enabled,
             "parallelism.activation_checkpointing",
             f"full with compile under parallelism.tp={parallelism.tp} fails inside torch (its compiled backward "
             "cannot save a checkpointed block's tensor-parallel mesh); set compile=off or "
             "parallelism.activation_checkpointing=off")
    check_activation_checkpointing(cfg)
    check_pipeline(cfg)
    check_launch(parallelism)
    if parallelism.global_batch is not None:
        _require(parallelism.global_batch > 0, "parallelism.global_batch",
                 f"must be a positive integer or null; got {parallelism.global_batch}")
    _require(parallelism.timeout_s > 0, "parallelism.timeout_s", f"must be > 0; got {parallelism.timeout_s}")
    watchdog = parallelism.watchdog
    _require(watchdog.factor > 0, "parallelism.watchdog.factor", f"must be > 0; got {watchdog.factor}")
    _require(watchdog.enabled is False or 0 < watchdog.min_s < parallelism.timeout_s, "parallelism.watchdog.min_s",
             f"must be > 0 and below parallelism.timeout_s ({parallelism.timeout_s:g}), which ends a hung run before "
             f"the watchdog could say where it hangs; got {watchdog.min_s}; lower it or raise parallelism.timeout_s")
    _require(parallelism.straggler.factor > 1, "parallelism.straggler.factor",
             "must be > 1 (a rank this many times slower than the others is named); "
             f"got {parallelism.straggler.factor}")
    _require(parallelism.straggler.intervals >= 1, "parallelism.straggler.intervals",
             f"must be a positive integer (log intervals in a row); got {parallelism.straggler.intervals}")
    _require(parallelism.check_steps > 0, "parallelism.check_steps",
             f"must be a positive integer; got {parallelism.check_steps}")
    _require(parallelism.check_tolerance is None or parallelism.check_tolerance > 0, "parallelism.check_tolerance",
             f"must be > 0, or null for the precision's default; got {parallelism.check_tolerance}")
    _require(not parallelism.check or parallelism.strategy != "single", "parallelism.check",
             "compares ddp/fsdp with one process, so parallelism=single has nothing to compare; set it to false")
    _require(parallelism.ddp.bucket_cap_mb > 0, "parallelism.ddp.bucket_cap_mb",
             f"must be > 0; got {parallelism.ddp.bucket_cap_mb}")
    for key in ("param_dtype", "reduce_dtype"):
        _require(getattr(parallelism.fsdp, key) != "fp16", f"parallelism.fsdp.{key}",
                 "fp16 gradients overflow without a loss scaler, and trainflow runs none; use bf16 (the same "
                 "memory, fp32's range)")
    _require(parallelism.fsdp.min_params > 0, "parallelism.fsdp.min_params",
             f"must be > 0; got {parallelism.fsdp.min_params}")
    for key in ("shard_size", "replicate_size"):
        value = getattr(parallelism.hsdp, key)
        _require(value is None or value >= 1, f"parallelism.hsdp.{key}", f"must be a positive integer or null; got "
                 f"{value}")
    _require(parallelism.memory_budget_gb is None or parallelism.memory_budget_gb > 0, "parallelism.memory_budget_gb",
             f"must be > 0, or null for the device's free memory; got {parallelism.memory_budget_gb}")
    _require(0 < parallelism.memory_headroom <= 1, "parallelism.memory_headroom",
             f"must be in (0, 1]; got {parallelism.memory_headroom}")
    check_fault_tolerance(cfg)


def check_activation_checkpointing(cfg: RunConfig) -> None:
    """How often the mode applies, and the budget that only compile's partitioner can meet."""
    p = cfg.parallelism
    _require(p.activation_checkpointing_every >= 1, "parallelism.activation_checkpointing_every",
             f"must be a positive integer (1: every block); got {p.activation_checkpointing_every}")
    _require(0 <= p.activation_budget <= 1, "parallelism.activation_budget",
             f"must be in [0, 1] (the share of the activations compile may keep); got {p.activation_budget}")
    _require(p.activation_checkpointing != "budget" or cfg.compile.enabled, "parallelism.activation_checkpointing",
             "budget is met by torch.compile's partitioner (activation_memory_budget), and compile is off; set "
             "compile.enabled=true, or use full or selective")
    _require(p.activation_checkpointing != "budget" or p.tp == 1, "parallelism.activation_checkpointing",
             f"budget with parallelism.tp={p.tp} is untested with tensor parallel; use full or selective")


def check_pipeline(cfg: RunConfig) -> None:
    """Pipeline degrees a type cannot check; whether pp divides the world and the blocks, and the micro-batches the
    batch, is checked where those are known (trainflow.distributed.pipeline)."""
    p = cfg.parallelism
    _require(p.pp >= 1, "parallelism.pp", f"must be a positive integer (1: no pipeline); got {p.pp}")
    _require(p.microbatches is None or p.microbatches >= 1, "parallelism.microbatches",
             f"must be a positive integer, or null for one per pipeline stage; got {p.microbatches}")
    if p.pp == 1:
        return
    _require(p.strategy != Strategy.auto, "parallelism.pp",
             f"is {p.pp}, but parallelism=auto chooses the pipeline degree itself; to fix it, pick parallelism=fsdp "
             "or ddp with parallelism.pp")
    _require(p.strategy != "single", "parallelism.pp",
             f"splits the model over {p.pp} ranks, and parallelism=single trains one process; use parallelism=fsdp "
             f"with parallelism.pp={p.pp} (parallelism.nproc_per_node=N, N a multiple of {p.pp})")
    _require(not cfg.compile.enabled or not cfg.compile.check, "compile.check",
             f"compares the compiled and the eager model on one batch, and parallelism.pp={p.pp} runs the model as "
             "stages on several ranks; set compile.check=false (parallelism.check=true compares the run with one "
             "process)")
    _require(not cfg.compile.enabled or cfg.compile.scope != "model", "compile.scope",
             f"model compiles the model's forward, which parallelism.pp={p.pp} splits into stages; use "
             "compile.scope=blocks (or null)")
    _require(cfg.data.seq_lens is None, "data.seq_lens", f"varies the batch's shape, and "
             f"parallelism.pp={p.pp} sends activations of one shape between stages; set data.seq_lens=null")
    _require(not cfg.task._target_ and not cfg.task.loss_from_model, "parallelism.pp",
             f"{p.pp}: the last pipeline stage computes the loss from the model's output and the batch's targets "
             "(task=lm or classify), and this task computes it from the model itself; use task=lm or task=classify")


def check_launch(parallelism: ParallelismConfig) -> None:
    """How the run's processes start (what a launcher reads of a trainflow job too): its ranks per node and
    restarts."""
    nproc = parallelism.nproc_per_node
    _require(nproc == "auto" or nproc >= 1, "parallelism.nproc_per_node",
             f"must be a positive integer or auto; got {nproc}")
    _require(parallelism.strategy != "single" or nproc in (1, "auto"), "parallelism.nproc_per_node",
             f"parallelism=single runs one process; got {nproc}: use parallelism=ddp or parallelism=fsdp for {nproc} "
             "processes")
    _require(parallelism.max_restarts >= 0, "parallelism.max_restarts", f"must be >= 0; got {parallelism.max_restarts}")


def check_fault_tolerance(cfg: RunConfig) -> None:
    """parallelism.fault_tolerance=torchft: the extra installed, replica groups of one rank, DDP or FSDP ranks, a
    place in the groups."""
    parallelism = cfg.parallelism
    if parallelism.fault_tolerance == "off":
        return
    _require(torchft_installed(), "parallelism.fault_tolerance",
             "torchft is not installed: pip install 'trainflow[ft]', or set it to off")
    with_tp = f" with tp={parallelism.tp}" if parallelism.tp > 1 else ""
    _require(parallelism.strategy in {Strategy.single, Strategy.ddp, Strategy.fsdp} and parallelism.tp == 1,
             "parallelism.fault_tolerance",
             f"torchft trains replica groups of one rank, of DDP ranks or of FSDP ranks (parallelism=single, ddp or "
             f"fsdp, one job per group; FSDP groups replicated by torchft are HSDP); got parallelism="
             f"{parallelism.strategy}{with_tp}: run each group as parallelism=fsdp, or set it to off")
    ft = parallelism.ft
    assert ft is not None  # a run with fault tolerance carries its settings (trainflow.config.schema.typed_run)
    _require(ft.replica_groups >= 2, "parallelism.ft.replica_groups",
             f"must be >= 2 (one group has no peer to train on without); got {ft.replica_groups}")
    _require(0 <= ft.replica_id < ft.replica_groups, "parallelism.ft.replica_id",
             f"must be in [0, {ft.replica_groups - 1}] (parallelism.ft.replica_groups={ft.replica_groups}); "
             f"got {ft.replica_id}")
    _require(1 <= ft.min_replicas <= ft.replica_groups, "parallelism.ft.min_replicas",
             f"must be in [1, {ft.replica_groups}]; got {ft.min_replicas}")
    for key in ("timeout_s", "heartbeat_timeout_s", "join_timeout_s", "lighthouse_idle_s"):
        value = getattr(ft, key)
        _require(value > 0, f"parallelism.ft.{key}", f"must be > 0; got {value}")


def check_tp_sizes(cfg: RunConfig) -> None:
    """Tensor parallel splits trainflow's GPT by heads and hidden units: tp must divide each of them."""
    tp, model = cfg.parallelism.tp, cfg.model
    if tp in (1, -1) or model.n_head is None or model.n_embd is None:
        return
    bad = [f"model.{key}={size}" for key, size in (("n_head", model.n_head), ("n_embd", model.n_embd)) if size % tp]
    _require(not bad, "parallelism.tp", f"{tp} does not divide {' and '.join(bad)}: each TP rank takes whole heads "
             f"and an equal share of the hidden units; use a parallelism.tp that divides both, or change the model")


def check_checkpoint(cfg: RunConfig) -> None:
    """Checkpoint values a type cannot check (paths are checked where they are used)."""
    checkpoint = cfg.checkpoint
    if not checkpoint.enabled:  # a checkpoint key typed for a run that saves and resumes nothing was meant for one
        # that does (a sweep's typed keys are every job's, and some of its jobs may save); the stop signals act
        # without checkpoints too
        typed = sorted(k for k in command_line_keys() if k.startswith("checkpoint.")
                       and k not in ("checkpoint.enabled", "checkpoint.stop_signals"))
        typed = typed if single_run() else []
        _require(not typed, typed[0] if typed else "", "is set, but checkpoints are off (checkpoint=off, the "
                 "default): this run would save nothing and resume nothing; add checkpoint=dcp, or drop the key")
        return
    _require(checkpoint.every_steps > 0, "checkpoint.every_steps",
             f"must be a positive number of steps; got {checkpoint.every_steps}")
    max_steps = cfg.trainer.max_steps
    _require(checkpoint.save_final or checkpoint.every_steps <= max_steps, "checkpoint.every_steps",
             f"is {checkpoint.every_steps}, more than trainer.max_steps={max_steps}, and checkpoint.save_final is "
             f"false: this run would save no checkpoint; set checkpoint.every_steps to {max_steps} or less, or "
             "checkpoint.save_final=true")
    _require(checkpoint.keep_last >= 1, "checkpoint.keep_last",
             f"must be >= 1 (the newest committed checkpoint is always kept); got {checkpoint.keep_last}")
    _require(bool(checkpoint.resume), "checkpoint.resume", "is empty: use auto, never or a checkpoint path")
    _require(checkpoint.save_final or not checkpoint.export, "checkpoint.export",
             "exports the final weights, which needs checkpoint.save_final=true")
    _require(checkpoint.load == "all" or checkpoint.resume not in ("auto", "never"), "checkpoint.load",
             f"model loads the weights of the checkpoint named by checkpoint.resume, which is {checkpoint.resume}; "
             "set checkpoint.resume=<a step_N folder or run dir>")


def check_ledger(setting: str) -> None:
    """metrics.ledger (trainflow.record.ledger): a file path must not be a folder, and its folder, where it exists,
    must take files (auto and off need nothing)."""
    if setting in ("auto", "off"):
        return
    _require(bool(setting.strip()), "metrics.ledger", "is empty; give a file (e.g. /shared/ledger.jsonl), auto or off")
    path = Path(setting).expanduser()
    _require(not path.is_dir(), "metrics.ledger",
             f"{path} is a folder; give a file in it, e.g. {path / 'ledger.jsonl'}")
    folder = next((p for p in path.parents if p.exists()), None)
    problem = None if folder is None else "is not a folder" if not folder.is_dir() else cannot_write(folder)
    if problem is not None:
        reason = problem if isinstance(problem, str) else problem.strerror
        raise ConfigError(f"metrics.ledger: cannot write to {path} ({folder} {reason}); give a writable file, or "
                          "metrics.ledger=off")


def check_ladder(cfg: RunConfig) -> None:
    """Ladder knobs a type cannot check; only a ladder job has them."""
    if not isinstance(cfg, LadderRunConfig):
        return
    ladder = cfg.ladder
    _require(ladder.loss_rtol is None or ladder.loss_rtol > 0, "ladder.loss_rtol",
             f"must be > 0 or null; got {ladder.loss_rtol}")
    _require(ladder.log_every is None or ladder.log_every > 0, "ladder.log_every",
             f"must be a positive number of steps, or null for about 10 logs a rung; got {ladder.log_every}")
    _require(ladder.fp8_rtol is None or ladder.fp8_rtol > 0, "ladder.fp8_rtol",
             f"must be > 0 or null; got {ladder.fp8_rtol}")
    _require(ladder.resume_atol >= 0, "ladder.resume_atol",
             f"must be >= 0 (0: bit-identical); got {ladder.resume_atol}")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


SEED_RANGE = 2**32  # numpy's seed range; per-rank and per-epoch seeds derived from it stay within torch's 64 bits


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    """The config with every ${...} resolved: a broken interpolation is one line naming the key that holds it."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (InterpolationResolutionError, MissingMandatoryValue) as exc:
        problem = str(exc.msg).strip().splitlines()[0] if exc.msg else type(exc).__name__
        if problem.split()[0][1:].islower():  # a sentence goes on in lower case; a name (KeyError) keeps its capital
            problem = problem[0].lower() + problem[1:]
        raise ConfigError(f"{exc.full_key}: {problem}; fix the ${{...}} or give the value directly") from None


def _non_finite(node: Any, key: str = "") -> tuple[str, Any] | None:
    """The first key holding an inf or nan float (in a list too), with its value; None when all are finite."""
    if isinstance(node, dict):
        for name, value in node.items():
            if found := _non_finite(value, f"{key}.{name}" if key else str(name)):
                return found
    elif isinstance(node, list):
        if any(_non_finite(v, key) for v in node):
            return key, node
    elif isinstance(node, float) and not math.isfinite(node):
        return key, node
    return None


def check_model(cfg: RunConfig) -> None:
    """Sizes of the built-in models, and what the data asks of them, checked before anything is built."""
    model, data = cfg.model, cfg.data
    if str(model._target_).startswith("trainflow.models."):
        for key, value in model.kwargs.items():
            if isinstance(value, int) and not isinstance(value, bool):
                _require(value > 0, f"model.{key}", f"must be a positive integer; got {value}")
        if model.dropout is not None:
            _require(0 <= model.dropout < 1, "model.dropout", f"must be in [0, 1); got {model.dropout}")
    if model.block_size is not None and data.seq_len is not None:
        _require(data.seq_len <= model.block_size, "data.seq_len",
                 f"{data.seq_len} is longer than the model's context, model.block_size={model.block_size}; "
                 f"lower data.seq_len to <= {model.block_size} or raise model.block_size")
    if data._target_ == TextDataConfig._target_ and model.vocab_size is not None and cfg.tokenizer.kind == "bytes":
        _require(model.vocab_size >= BYTE_VOCAB, "model.vocab_size",  # other tokenizers: checked once built
                 f"is {model.vocab_size}, but data=text is byte-level: its tokens go up to {BYTE_VOCAB - 1}; set "
                 f"model.vocab_size={BYTE_VOCAB} or more")


def check_data(cfg: RunConfig) -> None:
    """The loader's keys, and those of trainflow's own data options."""
    data = cfg.data
    if data.seq_len is not None:
        _require(data.seq_len > 0, "data.seq_len", f"must be a positive number of tokens; got {data.seq_len}")
    workers = data.num_workers
    _require(workers >= 0, "data.num_workers", f"must be >= 0; got {workers}")
    if data.prefetch_factor is not None:
        _require(workers > 0, "data.prefetch_factor", "needs data.num_workers > 0 (or set it to null)")
        _require(data.prefetch_factor > 0, "data.prefetch_factor", f"must be > 0; got {data.prefetch_factor}")
    _require(not data.persistent_workers or workers > 0, "data.persistent_workers",
             "needs data.num_workers > 0 (or set it to false)")
    arguments = data.kwargs  # the factory's: data=text's and synthetic's own checked here
    if data._target_ == TextDataConfig._target_:
        _require(0 < arguments["val_fraction"] < 1, "data.val_fraction",
                 f"must be in (0, 1); got {arguments['val_fraction']}")
        if arguments["paths"] is not None:
            _require(len(arguments["paths"]) > 0, "data.paths",
                     "is empty: give files or folders, e.g. data.paths=[/path/to/corpus], or null for the default")
    if "num_samples" in arguments:
        _require(arguments["num_samples"] > 0, "data.num_samples", f"must be > 0; got {arguments['num_samples']}")


def check_config(cfg: DictConfig) -> RunConfig:
    """The composed config as the run reads it, typed once (trainflow.config.schema.typed_run), with the values a
    type cannot check checked; raise ConfigError naming the key and the fix."""
    check_targets_given(cfg)
    values = _resolved(cfg)
    if found := _non_finite(values):
        key, value = found
        what = "finite numbers" if isinstance(value, list) else "a finite number"
        raise ConfigError(f"{key}: must be {what}; got {value}")
    run = typed_run({**values, **settled_sections(cfg, values)})
    trainer = run.trainer
    for key in ("max_steps", "batch_size", "grad_accum", "log_every", "eval_steps"):
        value = getattr(trainer, key)
        _require(value > 0, f"trainer.{key}", f"must be a positive integer; got {value}")
    _require(trainer.excluded_steps >= 0, "trainer.excluded_steps", f"must be >= 0; got {trainer.excluded_steps}")
    every = trainer.eval_every
    _require(every == "auto" or every >= 0, "trainer.eval_every",
             f"must be auto or a number of steps >= 0 (0: only at the end); got {every}")
    _require(trainer.grad_clip >= 0, "trainer.grad_clip",
             f"must be >= 0 (0 disables clipping); got {trainer.grad_clip}")
    _require(0 <= trainer.seed < SEED_RANGE, "trainer.seed",
             f"must be an integer in [0, {SEED_RANGE - 1}]; got {trainer.seed}")
    if trainer.run_name is not None and (problem := run_name_problem(trainer.run_name)):
        raise ConfigError(f"trainer.run_name: {problem}")
    check_optim(run.optim)
    if run.metrics.peak_flops is not None:
        _require(run.metrics.peak_flops > 0, "metrics.peak_flops", f"must be > 0; got {run.metrics.peak_flops}")
    check_ledger(run.metrics.ledger)
    if trainer.cost_per_hour is not None:
        _require(trainer.cost_per_hour >= 0, "trainer.cost_per_hour",
                 f"must be >= 0 (the price of one device for an hour); got {trainer.cost_per_hour}")
    check_data(run)
    check_model(run)
    check_task(run)
    check_parallelism(run)
    check_profiler(run)
    check_compile(run)
    check_checkpoint(run)
    check_ladder(run)
    return run
