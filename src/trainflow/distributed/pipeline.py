"""Pipeline parallel (parallelism.pp): `model.blocks` split into stages over the mesh's pp dimension, run by one of
torch.distributed.pipelining's schedules.

The split. A model pipelines when it has `blocks` (a ModuleList or Sequential) and its forward skips the parts it
no longer holds (trainflow's GPT: `tok_emb is None` on a stage after the first, `head is None` before the last;
torchtitan's models are written the same way). Stage s of S holds blocks [s x B/S, (s+1) x B/S); the first stage
also holds the children registered before `blocks` (embeddings), the last those registered after (the final norm,
the head). Each stage is a copy of the model with the other parts set to None (blocks keep their own names:
`blocks.2` stays `blocks.2`), wrapped on its own (tensor parallel, activation checkpointing, FSDP2 over the
data-parallel part of the mesh). A rank holds one stage (1f1b, gpipe) or two (interleaved_1f1b and
interleaved_zb: stages r and r + pp; zbv: r and 2 pp - 1 - r).

What the rest of the run sees is `StageParts`: this rank's stages under the model's own parameter names, so the
optimizer, checkpoints (DCP saves each stage's tensors under their names: the union is the whole model, and a
checkpoint reshards to and from any layout without PP), the parity check and the export work as for any model.

Shared parameters across stages (GPT's head is tied to its token embedding, on the first and last stages): each
stage keeps a copy, their gradients are summed over the stages holding one before the optimizer step (as Megatron
does for tied embeddings), so every copy takes the same update; the gradient norm counts the copy of the first
name once, and checkpoints keep the optimizer state under that first name, as one process does.

The step (`Pipeline.run`): the first stage feeds the micro-batch's inputs, the last computes the task's loss
from its outputs and the targets, per pipeline micro-batch (`parallelism.microbatches` of them, each loss scaled by
1 / (micro-batches x trainer.grad_accum), so that the gradients are the batch's mean as in one process); the
step's loss and metrics go from the last stage to every stage (one broadcast of a few numbers), so that logging
on rank 0, the non-finite guard and the parity check read them as in any run.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trainflow.errors import ConfigError
from trainflow.models import model_blocks
from trainflow.optim import gradient_norm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from trainflow.distributed.process_group import DistEnv
    from trainflow.tasks import Task

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
ZERO_BUBBLE = ("interleaved_zb", "zbv")  # backward split into input and weight gradients
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # of activations sent between stages


def stages_per_rank(schedule: str) -> int:
    """1 for the single-stage schedules (1f1b, gpipe), 2 for the interleaved and zero-bubble ones."""
    return 1 if schedule in ("1f1b", "gpipe") else 2


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages rank `pp_rank` of the pipeline holds, in the order its schedule lists them."""
    if schedule == "zbv":  # V-shaped: down the ranks, then back up
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + pp * v for v in range(stages_per_rank(schedule))]


def blocks_per_stage(model: nn.Module, pp: int, schedule: str) -> int:
    """Blocks of each stage; one line when the model has no `blocks` or they do not divide into the stages."""
    blocks = model_blocks(model)
    stages = pp * stages_per_rank(schedule)
    if blocks is None:
        raise ConfigError(f"parallelism.pp: pipeline stages are made of model.blocks, and {type(model).__name__} has "
                          "no `blocks` list (a ModuleList of its repeated layers); set parallelism.pp=1")
    if len(blocks) % stages:
        divisors = [d for d in range(1, len(blocks) + 1) if len(blocks) % (d * stages_per_rank(schedule)) == 0]
        raise ConfigError(f"parallelism.pp: {pp} x {stages_per_rank(schedule)} stage(s) per rank "
                          f"(pp_schedule={schedule}) = {stages} stages do not divide the model's {len(blocks)} "
                          f"blocks; use parallelism.pp in {', '.join(map(str, divisors))} or a model whose number "
                          "of blocks is a multiple of the stages")
    own = [name for name, p in model.named_parameters(recurse=False)]
    if own:
        raise ConfigError(f"parallelism.pp: {type(model).__name__} holds parameters of its own ({', '.join(own)}) "
                          "outside its submodules, which no stage can own; move them into a submodule")
    return len(blocks) // stages


def microbatches(requested: int | None, batch_size: int, pp: int, schedule: str) -> int:
    """Pipeline micro-batches per `batch_size` (null: one per stage); one line when they are fewer than the
    stages or do not divide it."""
    stages = pp * stages_per_rank(schedule)
    count = requested or stages
    if count < stages:
        raise ConfigError(f"parallelism.microbatches: {count} pipeline micro-batches are fewer than the pipeline's "
                          f"{stages} stages (pp_schedule={schedule}), and torch's schedules need one per stage at "
                          f"least; set parallelism.microbatches={stages} or more (null: {stages})")
    if batch_size % count:
        # only the counts that also pass the check above: one per stage at least
        fits = [d for d in range(stages, batch_size + 1) if batch_size % d == 0]
        use = f"use one of {', '.join(map(str, fits))}, or " if fits else ""
        raise ConfigError(f"parallelism.microbatches: {count} pipeline micro-batches do not divide the per-rank "
                          f"batch of {batch_size} (trainer.batch_size); {use}a trainer.batch_size that is a multiple "
                          f"of {count}")
    return count


def _layout_of(model: nn.Module) -> tuple[list[str], list[str]]:
    """(the children registered before `blocks`: the first stage's; those after it: the last stage's)."""
    names = list(model._modules)
    at = names.index("blocks")
    return names[:at], names[at + 1:]


def stage_copy(model: nn.Module, stage: int, stages: int, per: int) -> nn.Module:
    """A copy of `model` holding stage `stage`'s parts only (the rest None, the blocks under their own keys); the
    parts it does not hold are never copied."""
    before, after = _layout_of(model)
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    dropped = [getattr(model, n) for n in before if stage > 0] + [getattr(model, n) for n in after
                                                                 if stage < stages - 1]
    dropped += [b for key, b in model.blocks._modules.items() if key not in keep]
    memo = {id(m): None for m in dropped if m is not None}
    part = copy.deepcopy(model, memo)
    for key in [k for k, b in part.blocks._modules.items() if b is None]:
        del part.blocks._modules[key]  # not `del blocks[i]`, which would number the rest from 0 again
    return part


class StageParts(nn.Module):
    """This rank's pipeline stages under the model's own names: the parameters the optimizer steps, the state
    dict a checkpoint saves (blocks.2 is blocks.2), what the parity check gathers. Its forward is the pipeline's
    (`Pipeline.run`), never called; `chunks` are the stage modules the schedule runs."""

    def __init__(self, chunks: list[nn.Module], ids: list[int], stages: int, mesh: DeviceMesh,
                 whole_shapes: dict[str, tuple[tuple[int, ...], str]], model: nn.Module) -> None:
        super().__init__()
        self.chunks, self.ids, self.stages, self.mesh = chunks, ids, stages, mesh
        self.before = _layout_of(model)[0]  # the children the first stage holds besides its blocks
        self.whole_shapes = whole_shapes  # the whole model's state dict shapes: what a checkpoint is checked by
        if hasattr(model, "weights_layout"):
            self.weights_layout = model.weights_layout
        blocks = nn.ModuleList()
        for chunk in chunks:
            for name, child in chunk._modules.items():
                if name == "blocks":
                    blocks._modules.update(child._modules)
                elif child is not None:
                    self._modules[name] = child
        self.blocks = blocks
        # tensor parallel left the last stage's logits split by vocabulary: the loss runs under loss_parallel()
        self.vocab_parallel_output = any(getattr(chunk, "vocab_parallel_output", False) for chunk in chunks)
        self.pipeline: Pipeline | None = None  # set by the Pipeline built on these parts

    def train(self, mode: bool = True) -> StageParts:
        for chunk in self.chunks:  # the chunks' roots, which the schedule calls, are not children of the parts
            chunk.train(mode)
        return super().train(mode)

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a pipelined model runs through its Pipeline's step, not its forward")


def whole_state_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """The whole model's state dict names, shapes and dtypes (before it is split)."""
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}


def split_model(model: nn.Module, pp: int, schedule: str, mesh: DeviceMesh,
                wrap: Callable[[nn.Module], nn.Module]) -> StageParts:
    """This rank's stages of `model`, each wrapped by `wrap` (tensor parallel, activation checkpointing, FSDP2)."""
    per = blocks_per_stage(model, pp, schedule)
    stages = pp * stages_per_rank(schedule)
    ids = stage_ids(mesh["pp"].get_local_rank(), pp, schedule)
    chunks = [wrap(stage_copy(model, s, stages, per)) for s in ids]
    return StageParts(chunks, ids, stages, mesh, whole_state_shapes(model), model)


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The pipeline a model runs through (parallelism.pp > 1), else None."""
    return model.pipeline if isinstance(model, StageParts) else None


def shared_as_saved(optim_state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """The optimizer state with each stage's copy of a shared parameter under the name one process keys it by
    (GPT's head.weight on the last stage: tok_emb.weight); the copies take the same updates, so one is kept."""
    aliases = pipeline.aliases if (pipeline := pipeline_of(model)) else {}
    saved = {name: value for name, value in optim_state.items() if name not in aliases}
    for name, first in aliases.items():
        if name in optim_state:  # an optimizer without state (SGD without momentum) keeps none
            saved.setdefault(first, optim_state[name])
    return saved


def shared_as_own(optim_state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """The inverse of shared_as_saved: a saved state under the names this rank's stages hold."""
    if not (pipeline := pipeline_of(model)):
        return optim_state
    own = dict(optim_state)
    for name, first in pipeline.aliases.items():
        if first in optim_state:
            own[name] = optim_state[first]
    held = {name for name, _ in model.named_parameters()}
    return {name: value for name, value in own.items() if name in held}


class _Clock:
    """Seconds of the stages' own work (forward and backward of their micro-batches), measured around each call:
    on CUDA by events on the stream (read when the host syncs anyway), on CPU by the host's clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._pending: list[tuple[Any, Any]] = []

    def timed(self, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self._pending.append((start, end))
                self._drain(wait=False)  # the finished ones, without a sync: the list stays short
                return out
            begin = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - begin
            return out
        return call

    def _drain(self, wait: bool) -> None:
        """Add the recorded events' times, oldest first: all of them (`wait`), or those already finished."""
        while self._pending and (wait or self._pending[0][1].query()):
            start, end = self._pending.pop(0)
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3

    def read(self) -> float:
        """The seconds measured so far (CUDA: waits for the recorded events)."""
        self._drain(wait=True)
        return self.seconds


class Pipeline:
    """The schedule over this rank's stages, the loss the last stage computes, the gradients of shared
    parameters, and the pipeline's own figures (bubble, per-stage time and memory)."""

    def __init__(self, parts: StageParts, schedule: str, task: Task, batch_size: int, grad_accum: int,
                 requested_microbatches: int | None, metric_names: list[str], env: DistEnv,
                 whole: nn.Module, excluded_steps: int = 1) -> None:
        pp = parts.mesh["pp"]
        self.parts, self.task, self.env, self.schedule_name = parts, task, env, schedule
        self.group, self.pp = pp.get_group(), pp.size()
        self.microbatches = microbatches(requested_microbatches, batch_size, self.pp, schedule)
        self.scale = 1.0 / (self.microbatches * grad_accum)
        self.first, self.last = 0 in parts.ids, parts.stages - 1 in parts.ids
        derived = task.finish({"loss": 0.0})  # the loss, and what the task derives from the means (perplexity)
        self.metric_names = [n for n in metric_names if n not in derived]  # what its loss() returns
        self.clock, self.step_clock = _Clock(env.device), _Clock(env.device)  # the stages' work, the whole steps
        self.schedule = self._schedule()
        # each stage's global rank in this rank's pipeline; the last one computes the loss and sends it
        self.stage_ranks = {s: int(pp.mesh[r]) for r in range(self.pp) for s in stage_ids(r, self.pp, schedule)}
        self.last_rank = self.stage_ranks[parts.stages - 1]
        self.ties, self.aliases, self.counted = self._shared_parameters(whole)
        # the figures leave out the run's excluded steps (warm-up; the first infers the shapes between stages)
        self.steps, self.skip, self.grad_accum = 0, max(excluded_steps, 1) * grad_accum, grad_accum
        self._losses: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []  # each micro-batch's
        self._with_metrics = False
        parts.pipeline = self

    def _schedule(self) -> Any:
        """The schedule over stages of this rank's chunks, their forward and backward clocked."""
        # lazy: torch.distributed.pipelining costs ~0.4 s at start; only pp > 1 needs it
        from torch.distributed import pipelining

        stages = [pipelining.PipelineStage(chunk, sid, self.parts.stages, self.env.device, group=self.group)
                  for sid, chunk in zip(self.parts.ids, self.parts.chunks, strict=True)]
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self.clock.timed(getattr(stage, name)))
        cls = getattr(pipelining, SCHEDULES[self.schedule_name])
        run = stages if len(stages) > 1 else stages[0]
        return cls(run, self.microbatches, loss_fn=self._loss, scale_grads=False)

    # -- the step -------------------------------------------------------------------------------------------------

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one pipeline micro-batch, scaled so that the gradients are the batch's mean."""
        loss, metrics = self.task.loss(output, target, self._with_metrics)
        kept = {name: _local(value.detach()).float() for name, value in metrics.items()}
        self._losses.append((_local(loss.detach()).float(), kept))
        return loss * self.scale

    def run(self, batch: Any, with_metrics: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's forward and backward through the pipeline; its loss and metrics (means over the
        pipeline micro-batches) on every stage."""
        inputs, targets = self.task.split(batch)
        self._losses, self._with_metrics = [], with_metrics
        self.step_clock.timed(self.schedule.step)(*((inputs,) if self.first else ()),
                                                  target=targets if self.last else None)
        self.steps += 1
        if self.steps <= self.skip:
            for clock in (self.clock, self.step_clock):
                clock.read()
                clock.seconds = 0.0
        names = self.metric_names if with_metrics else []
        values = None
        if self.last:  # the micro-batches' own (the first step's shape inference computes one more loss before)
            per_micro = [torch.stack([loss, *(metrics[n] for n in names)])
                         for loss, metrics in self._losses[-self.microbatches:]]
            values = torch.stack(per_micro).mean(0)
        return self._from_last(values, names)

    def evaluate(self, batch: Any, with_metrics: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batch's loss and metrics, its forward through the stages in their order (each stage's whole-batch
        output sent to the rank of the next one), the last stage computing them. Not by the schedule: torch 2.13's
        `eval()` of its multi-stage schedules runs their backward actions too ("can't steal_bwd_input if this
        stage doesn't have backward")."""
        inputs, targets = self.task.split(batch)
        chunks = dict(zip(self.parts.ids, self.parts.chunks, strict=True))
        x = inputs
        for stage in range(self.parts.stages):
            if self.stage_ranks[stage] != self.env.rank:
                continue
            if stage > 0 and self.stage_ranks[stage - 1] != self.env.rank:
                x = self._receive(self.stage_ranks[stage - 1])
            x = chunks[stage](x)
            if stage < self.parts.stages - 1 and self.stage_ranks[stage + 1] != self.env.rank:
                self._send(x, self.stage_ranks[stage + 1])
        names = self.metric_names if with_metrics else []
        values = None
        if self.last:
            loss, metrics = self.task.loss(x, targets, with_metrics)
            values = torch.stack([_local(t.detach()).float() for t in (loss, *(metrics[n] for n in names))])
        return self._from_last(values, names)

    def _send(self, x: torch.Tensor, rank: int) -> None:
        header = torch.tensor([_DTYPES.index(x.dtype), x.dim(), *x.shape], device=x.device)
        dist.send(torch.nn.functional.pad(header, (0, 8 - len(header))), rank, group=self.group)
        dist.send(x.contiguous(), rank, group=self.group)

    def _receive(self, rank: int) -> torch.Tensor:
        header = torch.zeros(8, dtype=torch.int64, device=self.env.device)
        dist.recv(header, rank, group=self.group)
        dtype, dims = _DTYPES[int(header[0])], int(header[1])
        x = torch.empty(header[2:2 + dims].tolist(), dtype=dtype, device=self.env.device)
        dist.recv(x, rank, group=self.group)
        return x

    def _from_last(self, values: torch.Tensor | None,
                   names: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics the last stage computed (`values`), sent to every stage of this pipeline."""
        if values is None:
            values = torch.zeros(1 + len(names), device=self.env.device)
        dist.broadcast(values, src=self.last_rank, group=self.group)
        return values[0], {name: values[i + 1] for i, name in enumerate(names)}

    # -- shared parameters and the gradient norm ------------------------------------------------------------------

    def _shared_parameters(self, whole: nn.Module) -> tuple[list[tuple[list[nn.Parameter], Any]], dict[str, str],
                                                             list[nn.Parameter]]:
        """For each parameter the whole model holds under several names: this rank's copies and the group of the
        ranks holding one (None: only this rank); the names to key their optimizer state by; the parameters the
        gradient norm counts (each shared one once, on the rank holding its first name)."""
        by_param: dict[int, list[str]] = {}
        for name, param in whole.named_parameters(remove_duplicate=False):
            by_param.setdefault(id(param), []).append(name)
        local = dict(self.parts.named_parameters(remove_duplicate=False))
        ties, aliases, not_counted = [], {}, set()
        mesh = self.parts.mesh
        for names in (n for n in by_param.values() if len(n) > 1):
            holders = sorted({self._pp_rank_of(name) for name in names})
            mine = list({id(local[n]): local[n] for n in names if n in local}.values())
            for name in names[1:]:  # a copy of its own (another stage's part): counted and saved as the first
                if name in local and (names[0] not in local or local[name] is not local[names[0]]):
                    aliases[name] = names[0]
                    not_counted.add(id(local[name]))
            group = None
            if len(holders) > 1:
                grid = mesh.mesh.reshape(self.pp, -1)  # pp x (the rest of the mesh)
                lists = [[int(grid[p, c]) for p in holders] for c in range(grid.shape[1])]
                group, _ = dist.new_subgroups_by_enumeration(lists)
            if mine:
                ties.append((mine, group))
        counted = [p for p in self.parts.parameters() if id(p) not in not_counted]
        return ties, aliases, counted

    def _pp_rank_of(self, name: str) -> int:
        """The pipeline rank holding parameter `name` of the whole model."""
        top = name.split(".")[0]
        per = len(self.parts.blocks) // len(self.parts.ids)
        stage = 0 if top in self.parts.before else self.parts.stages - 1 if top != "blocks" else \
            int(name.split(".")[1]) // per
        return next(r for r in range(self.pp) if stage in stage_ids(r, self.pp, self.schedule_name))

    def sync_shared(self) -> None:
        """Sum the gradients of every shared parameter's copies (this rank's, then over the ranks holding one)."""
        with torch.no_grad():
            for copies, group in self.ties:
                grads = [_local(p.grad) for p in copies if p.grad is not None]
                if not grads or (len(grads) == 1 and group is None):
                    continue
                total = torch.stack(grads).sum(0)
                if group is not None:
                    dist.all_reduce(total, group=group)
                for grad in grads:
                    grad.copy_(total)

    def gradient_norm(self, clip: float) -> torch.Tensor:
        """The whole model's gradient norm (each stage's, summed in squares over the pipeline), every stage's
        gradients clipped by it when `clip` is set."""
        return gradient_norm(list(self.parts.parameters()), clip, counted=self.counted, group=self.group)

    def gather_to_first(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's tensors by name on the pipeline's first rank (the parity check's); the others get {}."""
        everyone: list[Any] = [None] * self.pp if self.parts.mesh["pp"].get_local_rank() == 0 else None
        dist.gather_object({k: v.cpu() for k, v in named.items()}, everyone, dst=int(self.parts.mesh["pp"].mesh[0]),
                           group=self.group)
        return {k: v for part in everyone for k, v in part.items()} if everyone else {}

    # -- what the run reports -------------------------------------------------------------------------------------

    def summary(self, peak_memory_bytes: int | None) -> dict[str, Any]:
        """Measured bubble (the share of the pipeline's step time this rank's stages did not compute), expected
        bubble (the schedule simulated), and every rank's stages, compute time per step and peak memory."""
        steps = max(self.steps - self.skip, 0) / self.grad_accum
        compute, step_s = self.clock.read(), self.step_clock.read()
        mine = {"rank": self.env.rank, "stages": self.parts.ids,
                "compute_s_per_step": compute / steps if steps else None,
                "pipeline_s_per_step": step_s / steps if steps else None,
                "bubble": 1 - compute / step_s if steps and step_s else None,
                "peak_memory_bytes": peak_memory_bytes}
        ranks: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(ranks, mine)
        bubbles = [r["bubble"] for r in ranks if r["bubble"] is not None]
        return {"schedule": self.schedule_name, "pp": self.pp, "stages": self.parts.stages,
                "stages_per_rank": len(self.parts.ids), "microbatches": self.microbatches,
                "bubble_fraction": sum(bubbles) / len(bubbles) if bubbles else None,
                "expected_bubble_fraction": simulated_bubble(self.schedule_name, self.pp, self.microbatches),
                "ranks": ranks}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------------------------------------------------------
# The bubble, by simulation of the schedule's own order of work


def _single_stage_order(schedule: str, pp: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's (kind, stage, micro-batch) in the order torch's single-stage schedules run them: GPipe every
    forward, then every backward; 1F1B min(m, pp - r) forwards, then one backward and one forward in turn."""
    order = []
    for rank in range(pp):
        warm = microbatches if schedule == "gpipe" else min(microbatches, pp - rank)
        actions = [("F", rank, i) for i in range(warm)]
        for i in range(microbatches - warm):
            actions += [("B", rank, i), ("F", rank, warm + i)]
        actions += [("B", rank, i) for i in range(microbatches - warm, microbatches)]
        order.append(actions)
    return order


def simulated_bubble(schedule: str, pp: int, microbatches: int, forward: float = 1.0,
                     backward: float = 2.0) -> float:
    """The share of a step a rank idles, averaged over the ranks: each rank runs its schedule's actions in order
    (1f1b and gpipe as torch runs them; the interleaved and zero-bubble schedules by torch's own action lists),
    each started when its rank is free and its inputs are there (a forward after the previous stage's forward of
    that micro-batch, a backward after the next stage's backward), communication free; a forward costs
    `forward`, a full backward `backward` (zero-bubble schedules split it in two halves: input, then weight)."""
    stages = pp * stages_per_rank(schedule)
    if stages_per_rank(schedule) == 1:
        queues = _single_stage_order(schedule, pp, microbatches)
    else:
        # lazy: torch.distributed.pipelining costs ~0.4 s at start; only the multi-stage schedules need it here
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # lazy: as the line above

        cls = getattr(schedules, SCHEDULES[schedule])
        queues = [[(a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions if a is not None]
                  for actions in get_schedule_ops(cls, pp, microbatches, stages_per_rank(schedule))]
    cost = {"F": forward, "B": backward, "I": backward / 2, "W": backward / 2}
    queues = [[a for a in queue if a[0] in cost] for queue in queues]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> when it finished
    free, busy = [0.0] * pp, [0.0] * pp
    while any(queues):
        progressed = False
        for rank, queue in enumerate(queues):
            while queue:
                kind, stage, mb = queue[0]
                if kind == "F":
                    needs = [("F", stage - 1, mb)] if stage > 0 else []
                elif kind == "W":
                    needs = [("I", stage, mb)]
                else:  # B or I: the gradient of this stage's output, from the next stage (or the loss)
                    needs = [("I", stage + 1, mb)] if stage < stages - 1 else [("F", stage, mb)]
                if any(n not in done for n in needs):
                    break
                start = max([free[rank], *(done[n] for n in needs)])
                free[rank] = start + cost[kind]
                busy[rank] += cost[kind]
                done[(kind, stage, mb)] = free[rank]
                if kind == "B":  # a full backward gives the input gradient too
                    done[("I", stage, mb)] = free[rank]
                queue.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} order on {pp} ranks deadlocks in the simulation")
    span = max(free)
    return sum(1 - b / span for b in busy) / pp
