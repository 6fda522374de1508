"""What a rank is doing is declared by the code doing it (trainflow.util.activity), and the watchdog reads that: an
evaluation, a compile and a save each declare themselves where they run (a real evaluation in a real run, a real
compile through dynamo's callbacks, real DCP saves, sync and async), and an evaluation longer than the watchdog's
bound is not reported as a hang while a step as long is."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.runs import ROOT, ok, train

from trainflow.checkpoint.safe_io import ChecksummingWriter
from trainflow.compile.compiler import _declare_compiles
from trainflow.tasks import cross_entropy
from trainflow.util import activity
from trainflow.util.activity import Activity, current, doing, ended, started, threads_doing


def test_declarations_nest_and_each_ends_its_own() -> None:
    me = threading.get_ident()
    assert current(me) is Activity.STEP
    with doing(Activity.SAVING):
        started(Activity.UPLOADING)
        assert current(me) is Activity.UPLOADING and threads_doing(Activity.UPLOADING) == [me]
        with doing(Activity.EVALUATING):
            assert current(me) is Activity.EVALUATING
        assert current(me) is Activity.UPLOADING
        ended(Activity.UPLOADING)
        ended(Activity.COMPILING)  # never declared: ignored
        assert current(me) is Activity.SAVING
    assert current(me) is Activity.STEP and me not in activity._stacks


def test_another_thread_declaration_is_ended_by_the_thread_that_waits_for_it() -> None:
    """A failed upload never reaches its own end: the waiting thread ends it, so no stale marker outlives it."""
    declared = threading.Event()
    holder: list[int] = []

    def upload() -> None:
        holder.append(threading.get_ident())
        started(Activity.UPLOADING)
        declared.set()

    thread = threading.Thread(target=upload)
    thread.start()
    declared.wait(10)
    thread.join()
    assert threads_doing(Activity.UPLOADING) == holder
    ended(Activity.UPLOADING, holder[0])
    assert threads_doing(Activity.UPLOADING) == [] and holder[0] not in activity._stacks


def test_a_compile_declares_itself_through_dynamos_callbacks() -> None:
    seen: list[Activity] = []

    def backend(graph: torch.fx.GraphModule, example: list[torch.Tensor]):
        seen.append(current(threading.get_ident()))  # inside the compile
        return graph.forward

    _declare_compiles()
    compiled = torch.compile(lambda x: torch.relu(x) * 2, backend=backend)
    assert torch.equal(compiled(torch.tensor([-1.0, 3.0])), torch.tensor([0.0, 6.0]))
    assert seen == [Activity.COMPILING]
    assert current(threading.get_ident()) is Activity.STEP  # over once compiled


def test_a_compile_after_dynamos_reset_still_declares_itself() -> None:
    """`torch._dynamo.reset()` (a user's code, a test) clears every compile callback: the next compile stage
    registers them again, once."""
    seen: list[Activity] = []

    def backend(graph: torch.fx.GraphModule, example: list[torch.Tensor]):
        seen.append(current(threading.get_ident()))
        return graph.forward

    _declare_compiles()
    torch._dynamo.reset()
    _declare_compiles()
    _declare_compiles()
    compiled = torch.compile(lambda x: torch.relu(x) + 1, backend=backend)
    assert torch.equal(compiled(torch.tensor([-1.0, 3.0])), torch.tensor([1.0, 4.0]))
    assert seen == [Activity.COMPILING]
    assert current(threading.get_ident()) is Activity.STEP
    assert len(torch._dynamo.callback.callback_handler.start_callbacks) == 1


class _WatchedWriter(ChecksummingWriter):
    """DCP's writer as trainflow uses it, noting what the thread writing each shard had declared."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.seen: list[tuple[int, Activity]] = []

    def _write_shard(self, path, storage_key, items, planner):  # noqa: ANN001, ANN202 (DCP's signature)
        me = threading.get_ident()
        self.seen.append((me, current(me)))
        return super()._write_shard(path, storage_key, items, planner)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, as DCP says
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_declares_its_upload_on_the_thread_that_writes_it(tmp_path: Path, mode: str) -> None:
    state = {"app": {"w": torch.arange(6.0), "b": torch.ones(3)}}
    writer = _WatchedWriter(tmp_path / "ckpt")
    main = threading.get_ident()
    if mode == "sync":
        dcp.save(state, storage_writer=writer)
    else:
        future = dcp.async_save(state, storage_writer=writer)
        with doing(Activity.WAITING_FOR_UPLOAD):
            assert current(main) is Activity.WAITING_FOR_UPLOAD
            future.result()
    writer.end_upload()
    assert writer.seen and {what for _, what in writer.seen} == {Activity.UPLOADING}
    writers = {ident for ident, _ in writer.seen}
    assert (main in writers) == (mode == "sync")  # async: DCP's upload thread, never the training thread
    assert threads_doing(Activity.UPLOADING) == [] and current(main) is Activity.STEP


SLEEP_S = 4.0  # 4x the watchdog's bound in the runs below
_calls = {"train": 0, "eval": 0}


def watched_task(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The seed MLP's classification loss; notes what its thread declared (in training and in evaluation) and
    sleeps past the watchdog's bound once where TEST_ACTIVITY_SLEEP_IN says: in the first evaluation of the loop
    (the probe before it is the first call in eval mode), or in the third training step."""
    mode = "train" if model.training else "eval"
    _calls[mode] += 1
    with open(os.environ["TEST_ACTIVITY_LOG"], "a") as log:
        log.write(json.dumps([mode, _calls[mode], current(threading.get_ident()).value]) + "\n")
    if os.environ.get("TEST_ACTIVITY_SLEEP_IN") == mode and _calls[mode] == {"eval": 2, "train": 3}[mode]:
        time.sleep(SLEEP_S)
    inputs, targets = batch
    return cross_entropy(model(inputs), targets), {}


def _watched_run(tmp_path: Path, sleep_in: str) -> tuple[list[list[str]], Path]:
    log = tmp_path / f"activity-{sleep_in}.jsonl"
    run_dir = tmp_path / sleep_in
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p),
           "TEST_ACTIVITY_LOG": str(log), "TEST_ACTIVITY_SLEEP_IN": sleep_in}
    ok(train(run_dir, "experiment=seed_mlp", "task=custom", "task._target_=test_activity.watched_task",
             "trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=3", "trainer.eval_steps=1",
             "trainer.excluded_steps=0", "logger=none", "parallelism.watchdog.enabled=true",
             "parallelism.watchdog.min_s=1", env=env))
    return [json.loads(line) for line in log.read_text().splitlines()], run_dir


def test_a_runs_evaluation_declares_itself_and_is_no_hang_while_a_step_as_long_is(tmp_path: Path) -> None:
    seen, run_dir = _watched_run(tmp_path, "eval")
    assert seen[0] == ["eval", 1, "step"], seen  # the probe batch, before the loop
    loop = seen[1:]
    assert {mode for mode, _, _ in loop} == {"train", "eval"}, seen
    assert {doing for mode, _, doing in loop if mode == "eval"} == {"evaluating"}, seen
    assert {doing for mode, _, doing in loop if mode == "train"} == {"step"}, seen
    # an evaluation of SLEEP_S (4x the bound of 1 s): the watchdog waited it out, no report
    assert not (run_dir / "hang" / "report.txt").exists()
    assert "hang: no step for" not in (run_dir / "train.log").read_text()
    # the same sleep in a training step: reported, naming where the task sleeps
    _, stepped = _watched_run(tmp_path, "train")
    report = (stepped / "hang" / "report.txt").read_text()
    assert report.startswith("hang: no step for ") and "test_activity.py" in report, report
