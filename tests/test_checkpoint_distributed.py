"""Checkpoint stage across ranks: DDP/FSDP2 resume bit for bit, checkpoints reshard N -> M with the sample stream
continuing exactly, and a stop signal on one rank stops every rank at the same step.

Every run keeps the global batch at 24 samples (parallelism.global_batch), so 1, 2 and 3 ranks consume the
same global sample stream: a resharded run must reproduce the reference run's per-step losses up to the
summation order of the gradient reduction (a repeated or skipped sample would change them by orders more).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import assert_close_losses, assert_same_tensors, committed, logged_steps
from helpers.runs import TINY_GPT, Run, losses_by_step, ok, start, train, wait_for, wait_for_log

BASE = [*TINY_GPT, "parallelism.global_batch=24", "trainer.max_steps=12", "trainer.eval_every=0",
        "trainer.eval_steps=2", "checkpoint.every_steps=4"]
FSDP2 = ["parallelism=fsdp", "parallelism.nproc_per_node=2"]


def kill_tree(proc) -> None:
    """SIGKILL the launcher and every worker it started (a node going down)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def workers(launcher: int) -> list[int]:
    """The pids of a self-launched run's workers in the order they were started (local rank 0 first)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == launcher:  # forked by the launcher's agent (whatever argv the launcher was started with)
            found.append((int(fields[19]), int(entry.name)))  # (start time, pid)
    return [pid for _, pid in sorted(found)]


@pytest.fixture(scope="module")
def fsdp_straight(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The reference: FSDP2 on 2 ranks, 12 uninterrupted steps, sync saves at 4, 8, 12."""
    return ok(train(tmp_path_factory.mktemp("fsdp") / "run", *BASE, *FSDP2, "checkpoint=dcp"))


def test_fsdp_sigkill_and_resume_is_bit_identical(fsdp_straight: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, *BASE, *FSDP2, "checkpoint=dcp_async", new_session=True)
    wait_for_log(run_dir, "checkpoint step 8: saving to ", proc)  # rank 0 logs it before any shard is written
    kill_tree(proc)
    # the kill landed inside the save of step 8 (its folder was never renamed): resume from step 4
    assert (run_dir / "checkpoints" / ".tmp-step_00000008").is_dir()
    assert committed(run_dir / "checkpoints") == ["step_00000004"]
    assert "checkpoint step 8 committed" not in (run_dir / "train.log").read_text()

    resumed = ok(train(run_dir, *BASE, *FSDP2, "checkpoint=dcp_async"))
    assert resumed.summary["resumed_from_step"] == 4 and resumed.summary["world_size"] == 2
    assert losses_by_step(run_dir) == losses_by_step(fsdp_straight.run_dir)
    assert_same_tensors(run_dir / "checkpoints" / "step_00000012",
                        fsdp_straight.run_dir / "checkpoints" / "step_00000012")
    manifest = json.loads((run_dir / "checkpoints" / "step_00000012" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {"__0_0.distcp", "__1_0.distcp"} <= manifest["files"].keys()


@pytest.fixture(scope="module")
def fsdp_to_single(fsdp_straight: Run, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """FSDP2 on 2 ranks -> one process: resume step 8 of the reference, save every 2 steps."""
    step8 = fsdp_straight.run_dir / "checkpoints" / "step_00000008"
    return ok(train(tmp_path_factory.mktemp("single") / "run", *BASE, "checkpoint=dcp",
                    f"checkpoint.resume={step8}", "checkpoint.every_steps=2"))


def test_reshard_fsdp2_to_single_continues_the_sample_stream(fsdp_straight: Run, fsdp_to_single: Run) -> None:
    summary = fsdp_to_single.summary
    assert summary["resumed_from_step"] == 8 and summary["world_size"] == 1 and summary["global_batch"] == 24
    assert summary["steps_this_run"] == 4
    manifest = json.loads((fsdp_to_single.run_dir / "checkpoints" / "step_00000012" / "manifest.json").read_text())
    assert manifest["samples_seen"] == 12 * 24
    assert_close_losses(losses_by_step(fsdp_to_single.run_dir), losses_by_step(fsdp_straight.run_dir), range(9, 13))
    assert [(c["key"], c["checkpoint"], c["used"]) for c in summary["checkpoint"]["resume_changes"]] == [
        ("trainer.batch_size", 12, 24), ("world size", 2, 1)]  # each change of the resume listed; the global batch
    log = (fsdp_to_single.run_dir / "train.log").read_text()
    assert "resume: trainer.batch_size is 24 in the config, 12 in the checkpoint; using the config's 24" in log
    assert ("resume: world size is 1 here, 2 in the checkpoint: model, optimizer and data position are resharded "
            "exactly; the per-rank RNG states are not restored (fresh per-rank seeds)") in log


def test_export_of_a_sharded_checkpoint_loads_into_the_plain_model(fsdp_straight: Run, tmp_path: Path) -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from trainflow.checkpoint import export_weights

    info = export_weights(fsdp_straight.run_dir / "checkpoints" / "step_00000012", tmp_path / "model.pt")
    assert info["step"] == 12
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    model = instantiate(OmegaConf.create(fsdp_straight.summary["config"]["model"]))
    model.load_state_dict(weights)  # strict: the FSDP shards were put back together, names unwrapped


def test_reshard_single_to_fsdp2_continues_the_sample_stream(
        fsdp_straight: Run, fsdp_to_single: Run, tmp_path: Path) -> None:
    step10 = fsdp_to_single.run_dir / "checkpoints" / "step_00000010"
    run = ok(train(tmp_path / "run", *BASE, *FSDP2, "checkpoint=dcp", f"checkpoint.resume={step10}"))
    assert run.summary["resumed_from_step"] == 10 and run.summary["world_size"] == 2
    assert_close_losses(losses_by_step(run.run_dir), losses_by_step(fsdp_straight.run_dir), range(11, 13))


@pytest.mark.slow
def test_reshard_fsdp2_to_fsdp3(fsdp_straight: Run, tmp_path: Path) -> None:
    step4 = fsdp_straight.run_dir / "checkpoints" / "step_00000004"
    run = ok(train(tmp_path / "run", *BASE, "parallelism=fsdp", "parallelism.nproc_per_node=3", "checkpoint=dcp",
                   f"checkpoint.resume={step4}"))
    assert run.summary["resumed_from_step"] == 4
    assert_close_losses(losses_by_step(run.run_dir), losses_by_step(fsdp_straight.run_dir), range(5, 13))


@pytest.mark.slow
def test_ddp_sigkill_resume_is_bit_identical_and_reshards_to_single(fsdp_straight: Run, tmp_path: Path) -> None:
    ddp = ["parallelism=ddp", "parallelism.nproc_per_node=2"]
    straight = ok(train(tmp_path / "straight", *BASE, *ddp, "checkpoint=dcp"))
    run_dir = tmp_path / "run"
    proc = start(run_dir, *BASE, *ddp, "checkpoint=dcp", new_session=True)
    wait_for(lambda: logged_steps(run_dir) >= 5, proc, "step 5")
    kill_tree(proc)
    resumed = ok(train(run_dir, *BASE, *ddp, "checkpoint=dcp"))
    assert resumed.summary["resumed_from_step"] == 4
    assert losses_by_step(run_dir) == losses_by_step(straight.run_dir)
    assert_same_tensors(run_dir / "checkpoints" / "step_00000012", straight.run_dir / "checkpoints" / "step_00000012")

    single = ok(train(tmp_path / "single", *BASE, "checkpoint=dcp",
                      f"checkpoint.resume={straight.run_dir / 'checkpoints' / 'step_00000008'}"))
    assert single.summary["resumed_from_step"] == 8
    assert_close_losses(losses_by_step(single.run_dir), losses_by_step(straight.run_dir), range(9, 13))


@pytest.mark.slow
@pytest.mark.parametrize(("target", "sig"), [("rank 1", signal.SIGUSR2), ("launcher", signal.SIGTERM)])
def test_a_stop_signal_stops_every_rank_at_the_same_step_with_exit_75(
        tmp_path: Path, target: str, sig: signal.Signals) -> None:
    """On one rank (the others learn it from the per-step all-reduce), or on the launcher (which passes it on)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, *BASE, *FSDP2, "checkpoint=dcp", "trainer.max_steps=200", "checkpoint.every_steps=100",
                 new_session=True)
    wait_for(lambda: logged_steps(run_dir) >= 3, proc, "step 3")
    if target == "launcher":
        proc.send_signal(sig)
    else:
        pids = workers(proc.pid)
        assert len(pids) == 2, pids
        os.kill(pids[1], sig)
    assert proc.wait(timeout=120) == 75
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoint"]["stopped_by"] == sig.name
    assert committed(run_dir / "checkpoints") == [f"step_{summary['steps']:08d}"]
    assert summary["steps"] < 200
