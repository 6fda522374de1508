"""The parity check (parallelism.check): a parallel run against one process on the same batches, and the
parallel layout's part of the summary."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainflow.config.schema import ParallelismConfig, TrainerConfig
from trainflow.data import StreamSampler, make_loader
from trainflow.distributed.mesh import layout
from trainflow.distributed.parallelism import full_parameters, is_parallelized
from trainflow.distributed.pipeline import pipeline_of
from trainflow.distributed.process_group import DistEnv, all_reduce_mean, node_count
from trainflow.loop.stages import Phase, Stage, StageContext, StepHooks
from trainflow.loop.state import LoopState
from trainflow.loop.step import StepInputs, no_region, train_step
from trainflow.optim import build_optimizer
from trainflow.util.device import autocast_for, matmul_math
from trainflow.util.tolerance import TOLERANCE, relative_error

log = logging.getLogger(__name__)


class ParityCheck(Stage):
    """With parallelism.check: rank 0 trains a one-process copy on the same global batches, then compares.

    The reference starts from a copy of the model taken before wrapping (the same initial weights every rank
    has), reads the global stream with one rank and micro-batches of batch_size x world_size (the union of the
    ranks' micro-batches: see data.py), and takes the same optimizer steps. Each step's loss (of the last
    micro-step, averaged over ranks) and, after check_steps, the parameters: the norm of the difference over the
    norm of what training moved the reference (its weights after the steps less its initial ones), all parameters
    as one vector. Relative to the weights instead, a few steps move them by a thousandth of their norm, so a
    gradient ten times too large would still pass. Every tensor of the model is compared (their count is said),
    else the check fails. The difference relative to the weights, and the worst single tensor, are reported too,
    not gated: a zero-initialised bias under Adam turns the rounding of a differently ordered all-reduce into a
    visibly different update (~1e-4 of its small norm).
    """

    phase = Phase.OBSERVE
    summary_key = "parallelism.check"  # the parallel layout's part of the summary holds its verdict

    def __init__(self, parallelism: ParallelismConfig, trainer: TrainerConfig, optim: dict[str, Any],
                 data: dict[str, Any],
                 env: DistEnv, model: nn.Module, dataset: Any,
                 task: Callable[[nn.Module, Any], tuple[torch.Tensor, dict]]) -> None:
        """`data`: the run's data section (its loader keys: num_workers, seq_lens, ...)."""
        if is_parallelized(model):
            raise RuntimeError("ParityCheck copies the model before parallelize() wraps or shards it")
        p, t = parallelism, trainer
        self.enabled = p.check and env.distributed
        self.steps = min(p.check_steps, t.max_steps) if self.enabled else 0
        self.tolerance = p.check_tolerance or TOLERANCE["parallelism.check"][matmul_math(env.device, t.precision)]
        self.env = env
        self.layout_name = layout(parallelism, env.world_size).name if self.enabled else env.strategy
        self.result: dict[str, Any] | None = None
        self._losses: list[tuple[float, float]] = []  # (ranks' mean, reference), on rank 0
        self._seen = 0
        if not (self.enabled and env.is_main):
            return
        self.reference = copy.deepcopy(model)
        # what training moves is measured from here (a copy: the reference's own tensors are updated in place)
        self._initial = {name: p.detach().clone() for name, p in self.reference.named_parameters(
            remove_duplicate=False)}
        optimizer, scheduler = build_optimizer(self.reference, optim, t.max_steps, env.device)
        sampler = StreamSampler(len(dataset), t.batch_size * env.dp_size, 0, 1, t.seed)
        # the loop's own step on the reference: one process, the union of the ranks' micro-batches
        self._reference_inputs = StepInputs(
            t, LoopState(self.reference, optimizer, scheduler), task, iter(make_loader(dataset, sampler, data, False)),
            trainable=list(self.reference.parameters()), autocast=autocast_for(env.device, t.precision),
            name_part=no_region, hooks=StepHooks.of([]),  # the run's own stages watch the run, not its reference
            batch_device=env.device if env.device.type != "cpu" else None, pin=False, steps_schedule=True,
            metrics_every_step=False, global_batch=t.batch_size * env.dp_size * t.grad_accum)

    @classmethod
    def build(cls, ctx: StageContext) -> ParityCheck:
        cfg = ctx.cfg
        return cls(cfg.parallelism, cfg.trainer, cfg.optim, cfg.data, ctx.env, ctx.model, ctx.data.train, ctx.task)

    def _reference_step(self) -> float:
        """One step of the reference, by `train_step`; its last micro-step's loss."""
        train_step(self._reference_inputs)
        return self._reference_inputs.state.loss.item()

    def excluded_steps(self) -> int:
        """The checked steps: the reference trains beside them, which is not the parallel run's speed."""
        return self.steps

    def after_step(self, state: LoopState) -> bool:
        """On every rank after each optimizer step: compare the last micro-step's loss; then the parameters."""
        if self.result is None:
            self._compare(state.step, state.model, state.loss)
        return False

    def _compare(self, step: int, model: nn.Module, loss: torch.Tensor) -> None:
        self._seen += 1
        if step != self._seen:  # resumed: the reference started from the initial weights
            self.result = {"skipped": f"the run resumed at step {step - 1}; the check compares from step 0"}
            self._release()
            return
        mean_loss = all_reduce_mean(loss.detach().float().clone(), self.env).item()
        if self.env.is_main:
            self._losses.append((mean_loss, self._reference_step()))
        if step < self.steps:
            return
        diff_sq, ref_sq, moved_sq, worst, worst_name = 0.0, 0.0, 0.0, 0.0, ""
        gathered = dict(full_parameters(model))  # every rank takes part in the gathers
        if pipeline := pipeline_of(model):  # each stage holds its own parameters: all of them to rank 0
            gathered = pipeline.gather_to_first(gathered)
        # a shared parameter under each of its names the run holds (a pipeline's stages each keep a copy)
        reference = {name: p for name, p in self.reference.named_parameters(remove_duplicate=False)
                     if name in gathered} if self.env.is_main else {}
        for name, ref in reference.items():
            if self.env.is_main:
                a, b = gathered[name].double(), ref.detach().double()
                diff_sq += float((a - b).square().sum())
                ref_sq += float(b.square().sum())
                moved_sq += float((b - self._initial[name].double()).square().sum())
                tensor_diff = relative_error(a, b)
                if tensor_diff >= worst:
                    worst, worst_name = tensor_diff, name
        if self.env.is_main:
            loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in self._losses)
            param_diff = math.sqrt(diff_sq / max(ref_sq, 1e-24))
            update_diff = math.sqrt(diff_sq / max(moved_sq, 1e-24))
            # a tied tensor counts once, whether the run holds it under one name (DDP, FSDP) or each (a pipeline)
            tensors = len({id(p) for p in reference.values()})
            model_tensors = len(list(self.reference.parameters()))
            passed = (loss_diff <= self.tolerance and update_diff <= self.tolerance
                      and 0 < tensors == model_tensors)
            self.result = {
                "steps": step, "tolerance": self.tolerance, "passed": passed,
                "tensors": tensors, "model_tensors": model_tensors,
                "losses": [a for a, _ in self._losses], "reference_losses": [b for _, b in self._losses],
                "loss_rel_diff": loss_diff, "update_rel_diff": update_diff, "param_rel_diff": param_diff,
                "worst_tensor": worst_name, "worst_tensor_rel_diff": worst,
            }
            (log.info if passed else log.error)(
                "parity check %s: %s on %d ranks vs one process after %d steps, %d of the model's %d tensors "
                "compared: loss rel diff %.1e, parameter diff %.1e of the update (%.1e of the weights; worst tensor "
                "%s: %.1e), tolerance %.0e", "passed" if passed else "FAILED", self.layout_name, self.env.world_size,
                step, tensors, model_tensors, loss_diff, update_diff, param_diff, worst_name, worst, self.tolerance)
        else:
            self.result = {}
        self._release()

    def _release(self) -> None:
        for name in ("reference", "_reference_inputs", "_initial"):
            self.__dict__.pop(name, None)

    def summary(self, steady: dict[str, Any] | None = None) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return self.result or {"skipped": f"the run ended before parallelism.check_steps={self.steps}"}


def parallelism_summary(parallelism: ParallelismConfig, trainer: TrainerConfig, env: DistEnv,
                        steady: dict[str, float] | None) -> dict[str, Any]:
    """The parallel layout, global batch, throughput in total and per rank (the parity check adds its verdict)."""
    out: dict[str, Any] = {
        "strategy": env.strategy,
        "world_size": env.world_size,
        "nodes": node_count(env.world_size),
        "backend": dist.get_backend() if env.distributed and dist.is_initialized() else None,
        "per_rank_batch": trainer.batch_size,
        "grad_accum": trainer.grad_accum,
        "global_batch": trainer.batch_size * env.dp_size * trainer.grad_accum,
    }
    if env.distributed:
        found = layout(parallelism, env.world_size)
        out["layout"] = found.name
        if found.summary():
            out["mesh"] = found.summary()
    if steady:
        for key in ("samples_per_sec", "tokens_per_sec"):
            out[f"{key}_total"] = steady[key]
            out[f"{key}_per_rank"] = steady[key] / env.world_size
    return out
