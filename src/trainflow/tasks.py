"""The task: what turns a batch into the loss and the metrics, for training, evaluation and every check.

- `lm`: next-token cross-entropy; perplexity; tokens/s (tokens counted from the batch's targets).
- `classify`: cross-entropy, accuracy, top-k accuracy (when the model has more than k classes).
- `task._target_`: the user's callable of (model, batch) returning (loss, {name: scalar tensor}).

Batches for lm and classify: a tuple/list `(inputs, targets)`, targets already aligned with the logits (as in
`cross_entropy(model(inputs), targets)`: data=text shifts by one token when it cuts windows), or a dict with
`input_ids` and `labels` (lm) or `inputs` and `targets` (classify). Targets of -100 are ignored, as in Hugging Face.
With `task.loss_from_model` (lm) the model computes its own loss: `model(**batch)` for a dict (a Hugging Face causal
LM given `labels` equal to `input_ids` shifts them itself), `model(*batch)` for a tuple; the loss is `output.loss`,
`output["loss"]` or the output itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainflow.config.schema import TaskSection
from trainflow.errors import ConfigError, DataError
from trainflow.util.targets import WHAT, bound_callable

Metrics = dict[str, torch.Tensor]


class Task:
    """Loss and metrics of a batch; `count` says how many samples and tokens a batch holds (shapes only: no sync)."""

    is_lm = False  # tokens/s and perplexity make sense

    def __init__(self, monitor: str = "loss", mode: str = "min") -> None:
        self.monitor, self.mode = monitor, mode

    def __call__(self, model: Callable, batch: Any, with_metrics: bool = True) -> tuple[torch.Tensor, Metrics]:
        """The loss and, `with_metrics`, the metrics (the training step asks for them on the steps that log them,
        as task.train_metrics says)."""
        raise NotImplementedError

    def count(self, batch: Any) -> tuple[int, int]:
        """(samples, tokens) of a batch: the leading size of its first tensor; no tokens."""
        first = next(iter(tensors(batch)), None)
        return (first.shape[0] if first is not None and first.dim() else 1), 0

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        """Figures derived from the means over batches (perplexity is exp of the mean loss, not a mean of exps)."""
        return means

    def split(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """(the model's inputs, the targets) of a batch: a pipeline's first stage takes the one, its last the other."""
        raise NotImplementedError(f"{type(self).__name__} computes its loss from the model itself")

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor,
             with_metrics: bool = True) -> tuple[torch.Tensor, Metrics]:
        """The loss and metrics of the model's outputs (what `__call__` computes after the forward)."""
        raise NotImplementedError(f"{type(self).__name__} computes its loss from the model itself")


class LanguageModel(Task):
    is_lm = True

    def __init__(self, monitor: str = "loss", mode: str = "min", loss_from_model: bool = False) -> None:
        super().__init__(monitor, mode)
        self.loss_from_model = loss_from_model

    def __call__(self, model: Callable, batch: Any, with_metrics: bool = True) -> tuple[torch.Tensor, Metrics]:
        if self.loss_from_model:
            output = model(**batch) if isinstance(batch, Mapping) else model(*batch)
            return model_loss(output), {}
        inputs, targets = pair(batch, "input_ids", "labels", "lm")
        return cross_entropy(model(inputs), targets), {}

    def split(self, batch: Any) -> tuple[Any, torch.Tensor]:
        return pair(batch, "input_ids", "labels", "lm")

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor,
             with_metrics: bool = True) -> tuple[torch.Tensor, Metrics]:
        return cross_entropy(outputs, targets), {}

    def count(self, batch: Any) -> tuple[int, int]:
        if isinstance(batch, Mapping) and self.loss_from_model:
            targets = batch.get("labels", batch.get("input_ids"))
        else:
            targets = pair(batch, "input_ids", "labels", "lm")[1]
        if not isinstance(targets, torch.Tensor):
            return super().count(batch)
        return targets.shape[0], targets.numel()

    def finish(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "perplexity": math.exp(min(means["loss"], 50.0))}


class Classification(Task):
    def __init__(self, monitor: str = "loss", mode: str = "min", top_k: int = 5) -> None:
        super().__init__(monitor, mode)
        self.top_k = top_k

    def __call__(self, model: Callable, batch: Any, with_metrics: bool = True) -> tuple[torch.Tensor, Metrics]:
        inputs, targets = pair(batch, "inputs", "targets", "classify")
        return self.loss(model(inputs), targets, with_metrics)

    def split(self, batch: Any) -> tuple[Any, torch.Tensor]:
        return pair(batch, "inputs", "targets", "classify")

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor,
             with_metrics: bool = True) -> tuple[torch.Tensor, Metrics]:
        loss = cross_entropy(outputs, targets)
        return loss, (self.metrics(outputs.detach(), targets) if with_metrics else {})

    def metrics(self, logits: torch.Tensor, targets: torch.Tensor) -> Metrics:
        """Accuracy and top-k accuracy of detached logits: nothing to record for autograd, so no grad context
        (ten tensor ops of ~5-8 us each: ~20% of the seed MLP's step when every step computes them)."""
        logits, targets = logits.flatten(0, -2), targets.flatten()  # [B, T, C]: a prediction per position
        if logits.shape[-1] <= self.top_k:
            return {"accuracy": (logits.argmax(-1) == targets).float().mean()}
        # the share of samples whose target is the k-th prediction, for each k: the first is the accuracy, and
        # (a target is at most one of the top k) their sum the top-k accuracy
        hits = (logits.topk(self.top_k, dim=-1).indices == targets[:, None]).float().mean(0)
        return {"accuracy": hits[0], f"top{self.top_k}_accuracy": hits.sum()}

    def count(self, batch: Any) -> tuple[int, int]:
        return pair(batch, "inputs", "targets", "classify")[1].shape[0], 0


class UserTask(Task):
    """task._target_: the user's callable; it may return the loss alone (no metrics)."""

    def __init__(self, fn: Callable, target: str, monitor: str = "loss", mode: str = "min") -> None:
        super().__init__(monitor, mode)
        self.fn, self.target = fn, target

    def __call__(self, model: Callable, batch: Any, with_metrics: bool = True) -> tuple[torch.Tensor, Metrics]:
        result = self.fn(model, batch)  # the user's callable computes its metrics every step
        if isinstance(result, torch.Tensor):
            return result, {}
        loss, metrics = result
        return loss, dict(metrics)

    def check_result(self, loss: Any, metrics: Metrics) -> None:
        """What the loop relies on: a scalar loss tensor and scalar metric tensors, said once at the probe."""
        wrong = [k for k, v in metrics.items() if not (isinstance(v, torch.Tensor) and v.numel() == 1)]
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1) or wrong:
            what = f"metrics {', '.join(wrong)} are not" if wrong else f"its loss is a {_describe(loss)}, not"
            raise ConfigError(f"task._target_: {self.target} returned a result whose {what} a one-element tensor; "
                              "return (loss, {name: scalar tensor})")


def build_task(task: TaskSection, lm_data: bool) -> Task:
    """The task the config names; kind=auto: lm for language-model data (a model with a vocab_size), else classify."""
    if task._target_:  # the user's callable, bound to its keyword arguments
        fn = bound_callable("task", task._target_, task.kwargs, WHAT["task"])
        return UserTask(fn, task._target_, task.monitor, task.mode)
    kind = task.kind if task.kind != "auto" else "lm" if lm_data else "classify"
    if kind == "lm":
        return LanguageModel(task.monitor, task.mode, task.loss_from_model)
    return Classification(task.monitor, task.mode, task.top_k)


def probe(task: Task, model: nn.Module, sample: Any, data_name: str, model_name: str) -> list[str]:
    """A small batch through the task before training (eval mode, no grad, the random streams untouched).

    A batch the model cannot take is one line naming the data, the model and the shapes, instead of a traceback
    from deep inside forward; a task.monitor the task does not produce is refused. Returns the metric names.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(sample)):
            loss, metrics = task(model, sample)
    except (DataError, ConfigError):
        raise
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DataError(f"data: {data_name} gives batches of {_describe(sample)}, which the task "
                        f"{type(task).__name__} cannot put through model {model_name} ({type(exc).__name__}: "
                        f"{message}); make the data's items what the model's forward takes, or change model.*") \
            from None
    finally:
        model.train(was_training)
    if isinstance(task, UserTask):
        task.check_result(loss, metrics)
    names = list(task.finish({"loss": float(loss.detach().float()), **{k: 0.0 for k in metrics}}))
    if task.monitor not in names:
        raise ConfigError(f"task.monitor: {task.monitor!r} is not a metric of this task ({', '.join(names)}); set "
                          "task.monitor to one of them")
    return names


def add_metrics(totals: Metrics, metrics: Metrics) -> None:
    """Sum `metrics` into `totals` on the device, detached and in fp32 (no host sync: read once, at the end)."""
    for name, value in metrics.items():
        value = value.detach().float()
        totals[name] = totals[name] + value if name in totals else value


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classifiers ([B, C]) and language models ([B, T, V]) alike; targets of -100 are ignored."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: output.loss, output["loss"], or the output when it is the loss."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ConfigError(f"task.loss_from_model: the model returned a {type(output).__name__} without a loss; give "
                          "the model labels (a dict batch with a labels key) or set task.loss_from_model=false")
    return loss


def pair(batch: Any, input_key: str, target_key: str, kind: str) -> tuple[Any, torch.Tensor]:
    """(inputs, targets) of a tuple/list batch, or of a dict batch by its keys."""
    if type(batch) is tuple and len(batch) == 2:  # the built-in data's batches: no ABC checks (~2 us, twice a step)
        return batch
    if isinstance(batch, Mapping):
        missing = [k for k in (input_key, target_key) if k not in batch]
        if not missing:
            return batch[input_key], batch[target_key]
        raise DataError(f"data: task {kind} takes dict batches with keys {input_key} and {target_key}, but the "
                        f"batches have {', '.join(map(str, batch)) or 'no keys'}; rename the dataset's keys, or set "
                        "task._target_ to a task that reads them")
    if isinstance(batch, Sequence) and len(batch) == 2:
        return batch[0], batch[1]
    raise DataError(f"data: task {kind} takes batches of (inputs, targets) or a dict with {input_key} and "
                    f"{target_key}; got {_describe(batch)}; return such items, or set task._target_")


def tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in a nested batch, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in tensors(v)]
    if isinstance(batch, list | tuple):
        return [t for v in batch for t in tensors(v)]
    return []


def _describe(batch: Any) -> str:
    """Shapes and dtypes of a nested batch, e.g. {input_ids: [8, 32] int64, labels: [8, 32] int64}."""
    if isinstance(batch, torch.Tensor):
        return f"{list(batch.shape)} {str(batch.dtype).removeprefix('torch.')}"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, list | tuple):
        return "(" + ", ".join(_describe(v) for v in batch) + ")"
    return type(batch).__name__


def _rng_devices(sample: Any) -> list[int]:
    """The CUDA devices a batch is on: their random streams are forked too."""
    return sorted({t.device.index or 0 for t in tensors(sample) if t.device.type == "cuda"})
