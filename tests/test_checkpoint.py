"""Checkpoint stage, one process: real `train.py` runs, real files, real SIGKILL/SIGTERM, real full disks.

The reference is one uninterrupted run (`straight`); every interrupted-and-resumed run must reproduce its
per-step losses and final tensors bit for bit. Bad inputs must end in one line, exit 2, and leave the committed
checkpoints on disk byte-identical.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import assert_same_tensors, committed, logged_steps, read_tensors, tree_hash
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, Run, losses_by_step, one_line_error, start, train, wait_for
from omegaconf import OmegaConf

from trainflow.checkpoint.store import TMP_MARKER
from trainflow.conf import CONFIG_DIR
from trainflow.config.schema import typed_section
from trainflow.util.locks import LOCK_FILE

# 12 steps, a checkpoint every 4; evaluation only at the end, on 2 batches.
BASE = [*TINY_GPT, "trainer.max_steps=12", "trainer.eval_every=0", "trainer.eval_steps=2",
        "checkpoint.every_steps=4"]


# ---------------------------------------------------------------------------------------------------------------
# helpers


def entries(folder: Path) -> list[str]:
    """What a checkpoint dir holds, besides the run lock."""
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_FILE)




# ---------------------------------------------------------------------------------------------------------------
# the reference run


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """12 uninterrupted steps, sync saves at 4, 8, 12, keep_last=2, weights exported at the end."""
    run = train(tmp_path_factory.mktemp("straight") / "run", *BASE, "checkpoint=dcp", "checkpoint.keep_last=2",
                "checkpoint.export=true")
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_sync_run_commits_retains_verifies_and_exports(straight: Run) -> None:
    ckpts = straight.run_dir / "checkpoints"
    assert committed(ckpts) == ["step_00000008", "step_00000012"]  # step 4 fell to keep_last=2
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-")]
    manifest = json.loads((ckpts / "step_00000012" / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["world_size"] == 1
    assert manifest["samples_seen"] == 12 * 8
    assert manifest["torch_version"] == torch.__version__ and manifest["trainflow_version"]
    assert {name: (ckpts / "step_00000012" / name).stat().st_size for name in manifest["files"]} == manifest["files"]

    summary = straight.summary
    ck = summary["checkpoint"]
    assert ck["saves"] == 3 and ck["steps_saved"] == [4, 8, 12]
    assert ck["verified"] is True
    assert len(ck["blocked_s"]["per_save"]) == 3 and all(b > 0 for b in ck["blocked_s"]["per_save"])
    assert ck["bytes"] > 1_000_000  # 0.12M parameters + AdamW moments, fp32
    assert summary["resumed_from_step"] is None

    # the exported weights load with weights_only=True into a fresh model and equal the checkpoint's
    weights = torch.load(straight.run_dir / "model.pt", weights_only=True)
    saved = read_tensors(ckpts / "step_00000012")
    assert weights.keys() == {k.removeprefix("app.model.") for k in saved if k.startswith("app.model.")}
    assert all(torch.equal(w, saved[f"app.model.{k}"]) for k, w in weights.items())
    from hydra.utils import instantiate

    model = instantiate(OmegaConf.create(summary["config"]["model"]))
    model.load_state_dict(weights)  # strict: every key, every shape


def test_export_command_on_any_committed_checkpoint(straight: Run, tmp_path: Path) -> None:
    out = tmp_path / "weights" / "step8.pt"
    proc = run_process([str(Path(sys.executable).parent / "trainflow"), "export",
                        str(straight.run_dir / "checkpoints" / "step_00000008"), str(out)], ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "step 8" in proc.stdout
    weights = torch.load(out, weights_only=True)
    saved = read_tensors(straight.run_dir / "checkpoints" / "step_00000008")
    assert all(torch.equal(w, saved[f"app.model.{k}"]) for k, w in weights.items()) and len(weights) > 10


def test_export_refuses_what_is_not_a_committed_checkpoint(straight: Run, tmp_path: Path) -> None:
    from trainflow.checkpoint import export_weights
    from trainflow.errors import CheckpointError

    with pytest.raises(CheckpointError, match="nope does not exist"):
        export_weights(tmp_path / "nope", tmp_path / "out.pt")
    unfinished = tmp_path / ".tmp-step_00000004"
    shutil.copytree(straight.run_dir / "checkpoints" / "step_00000008", unfinished)
    (unfinished / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="is not a committed checkpoint"):
        export_weights(unfinished, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


# ---------------------------------------------------------------------------------------------------------------
# killed, stopped, resumed: bit-identical


@pytest.mark.parametrize("mode", ["dcp", "dcp_async"])
def test_sigkill_during_a_save_resumes_from_the_last_committed_bit_identically(
        straight: Run, tmp_path: Path, mode: str) -> None:
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    tmp = ckpts / ".tmp-step_00000008"
    proc = start(run_dir, *BASE, f"checkpoint={mode}", "checkpoint.keep_last=2")
    wait_for(lambda: tmp.is_dir(), proc, "the save of step 8 began", interval=0.001)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert committed(ckpts) == ["step_00000004"]  # the interrupted save is not a checkpoint
    assert tmp.is_dir()

    resumed = train(run_dir, *BASE, f"checkpoint={mode}", "checkpoint.keep_last=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from_step"] == 4
    assert "resumed from step 4" in (run_dir / "train.log").read_text()
    assert not tmp.exists()  # the leftover was removed at the start
    assert losses_by_step(run_dir) == losses_by_step(straight.run_dir)  # every step, exactly
    assert_same_tensors(ckpts / "step_00000012", straight.run_dir / "checkpoints" / "step_00000012")
    assert committed(ckpts) == ["step_00000004", "step_00000008", "step_00000012"]  # 4: resumed from, kept
    if mode == "dcp_async":
        ck = resumed.summary["checkpoint"]
        assert ck["mode"] == "async" and ck["saves"] == 2
        assert all(w > 0 for w in ck["write_s"]["per_save"])


def stop_with(sig: signal.Signals, run_dir: Path) -> int:
    """Start the reference config, send `sig` after step 5; check the clean stop; return the step it stopped at."""
    proc = start(run_dir, *BASE, "checkpoint=dcp", "checkpoint.every_steps=100")
    wait_for(lambda: logged_steps(run_dir) >= 5, proc, "step 5")
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 75
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert 5 <= stopped_at < 12
    assert summary["checkpoint"]["stopped_by"] == sig.name
    assert committed(run_dir / "checkpoints") == [f"step_{stopped_at:08d}"]
    output = (run_dir.parent / f"{run_dir.name}.out").read_text()
    assert "Traceback" not in output and "exit code 75" in output
    return stopped_at


def test_sigterm_saves_at_the_step_boundary_and_exits_75(tmp_path: Path) -> None:
    stop_with(signal.SIGTERM, tmp_path / "run")


def test_sighup_saves_at_the_step_boundary_and_exits_75(tmp_path: Path) -> None:
    """A closed terminal or ssh session: saved and stopped like SIGTERM, not lost."""
    stop_with(signal.SIGHUP, tmp_path / "run")


def test_sigusr1_saves_at_the_step_boundary_and_exits_75(tmp_path: Path) -> None:
    """SLURM's notice before a time limit (--signal=USR1@N), Lightning's requeue signal: saved and stopped like
    SIGTERM (before, its default action ended the run with nothing saved, exit 138)."""
    stop_with(signal.SIGUSR1, tmp_path / "run")


def test_checkpoint_stop_signals_chooses_the_signals_that_save(tmp_path: Path) -> None:
    """checkpoint.stop_signals=[SIGUSR1]: SIGTERM is left to its default action (the run ends at once, nothing saved
    past the last periodic checkpoint), as a job whose scheduler sends SIGTERM only to kill it would want."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, *BASE, "checkpoint=dcp", "checkpoint.stop_signals=[SIGUSR1]", "trainer.max_steps=100000")
    wait_for(lambda: logged_steps(run_dir) >= 5, proc, "step 5")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == -signal.SIGTERM
    saved = [int(name.removeprefix("step_")) for name in committed(run_dir / "checkpoints")]
    assert saved and all(step % 4 == 0 for step in saved)  # the periodic saves only: no save on the signal
    assert not (run_dir / "summary.json").exists()


def test_a_stop_signal_without_checkpoints_ends_the_run_at_once_in_one_line(tmp_path: Path) -> None:
    """Nothing to save: the run ends at once with the exit code a shell gives a process SIGTERM ended (143), and
    one line says that nothing was saved (before, it ended without a word)."""
    run_dir = tmp_path / "run"
    no_checkpoint_keys = [a for a in BASE if not a.startswith("checkpoint.")]  # a checkpoint key alone is refused
    proc = start(run_dir, *no_checkpoint_keys, "trainer.max_steps=100000")
    wait_for(lambda: logged_steps(run_dir) >= 5, proc, "step 5")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    output = (run_dir.parent / f"{run_dir.name}.out").read_text()
    assert [line for line in output.splitlines() if line.startswith(("Stopped", "Error"))] == [
        "Stopped by SIGTERM: nothing was saved (checkpointing is off; with checkpoint=dcp a stop signal saves at the "
        "next step boundary first); the same command starts again from step 0 (exit code 143)"]
    assert "Traceback" not in output and not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("mode", ["dcp", "dcp_async"])
def test_sigterm_inside_a_save_lets_it_commit_then_stops_with_75(tmp_path: Path, mode: str) -> None:
    """SIGTERM while the save of step 4 writes (or uploads): that save commits, the run stops at the next step
    boundary with its checkpoint, one line, exit 75."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    proc = start(run_dir, *KILL, f"checkpoint={mode}", "trainer.max_steps=100000")
    wait_for(lambda: (ckpts / ".tmp-step_00000004").is_dir(), proc, "the save of step 4 began", interval=0.001)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoint"]["stopped_by"] == "SIGTERM" and summary["steps"] in (4, 5, 6)
    assert committed(ckpts) == sorted({"step_00000004", f"step_{summary['steps']:08d}"})
    output = (run_dir.parent / f"{run_dir.name}.out").read_text()
    assert [line for line in output.splitlines() if line.startswith(("Stopped", "Error"))] == [
        f"Stopped after a committed checkpoint; to resume, run the same command: {sys.executable} "
        f"{ROOT / 'train.py'} {' '.join(KILL)} checkpoint={mode} trainer.max_steps=100000 hydra.run.dir={run_dir}"]
    assert "Traceback" not in output


@pytest.mark.serial
def test_ctrl_c_inside_a_save_exits_130_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    tmp = ckpts / ".tmp-step_00000008"
    proc = start(run_dir, *KILL, "checkpoint=dcp")
    wait_for(lambda: (tmp / "__0_0.distcp").is_file(), proc, "the shard of step 8 began", interval=0.001)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    assert tmp.is_dir() and committed(ckpts) == ["step_00000004"]  # the interrupt landed inside the save
    output = (run_dir.parent / f"{run_dir.name}.out").read_text()
    assert "Traceback" not in output and "free space" not in output
    assert [line for line in output.splitlines() if line.startswith(("Interrupted", "Error"))] == [
        "Interrupted: stopped at once, without a save; committed checkpoints are untouched (a stop signal, SIGTERM "
        "say, saves at the next step boundary, then stops)"]

    resumed = train(run_dir, *KILL, "checkpoint=dcp")  # the leftover goes, the run goes on from step 4
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from_step"] == 4 and not tmp.exists()


@pytest.mark.slow
def test_after_sigusr2_the_same_command_resumes_exactly(straight: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stopped_at = stop_with(signal.SIGUSR2, run_dir)
    resumed = train(run_dir, *BASE, "checkpoint=dcp", "checkpoint.every_steps=100")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from_step"] == stopped_at
    assert losses_by_step(run_dir) == losses_by_step(straight.run_dir)


# A bigger model (20 MB checkpoints) so that a save lasts long enough to be killed at each of its stages.
KILL = [*TINY_GPT, "model.n_embd=256", "model.n_head=4", "trainer.max_steps=8", "trainer.eval_every=0",
        "trainer.eval_steps=2", "checkpoint.every_steps=4"]
STAGES = {  # what is on disk of the step-8 save when the kill lands
    "folder created": lambda tmp: tmp.is_dir(),
    "shard written": lambda tmp: (tmp / "__0_0.distcp").is_file(),
    ".metadata written": lambda tmp: (tmp / ".metadata").is_file(),
    "manifest written": lambda tmp: (tmp / "manifest.json").is_file(),
}


@pytest.fixture(scope="module")
def kill_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = train(tmp_path_factory.mktemp("kill_reference") / "run", *KILL, "checkpoint=dcp")
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("mode", ["dcp", "dcp_async"])
def test_sigkill_at_every_stage_of_a_save_resumes_from_a_committed_checkpoint(
        kill_reference: Run, tmp_path: Path, mode: str, stage: str) -> None:
    from trainflow.checkpoint import check_intact, list_committed

    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    tmp = ckpts / ".tmp-step_00000008"
    proc = start(run_dir, *KILL, f"checkpoint={mode}")
    # a stage too short to see (the manifest lives for microseconds) lets the kill land just after the commit
    wait_for(lambda: STAGES[stage](tmp) or (ckpts / "step_00000008").is_dir(), proc, stage, timeout=600,
             interval=0.001)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    listed = list_committed(ckpts)
    assert [c.step for c in listed] in ([4], [4, 8])
    assert tmp.is_dir() == (listed[-1].step == 4)  # killed before the commit's rename, or after it: never between
    for c in listed:
        check_intact(c, listed)
        assert read_tensors(c.path)

    resumed = train(run_dir, *KILL, f"checkpoint={mode}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["resumed_from_step"] == listed[-1].step
    assert not tmp.exists()
    assert losses_by_step(run_dir) == losses_by_step(kill_reference.run_dir)
    assert_same_tensors(ckpts / "step_00000008", kill_reference.run_dir / "checkpoints" / "step_00000008")


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line, exit 2, committed checkpoints untouched


def test_bad_values_are_refused_before_training(run_dir: Path) -> None:
    error = one_line_error(train(run_dir, *BASE, "checkpoint=dcp", "checkpoint.every_steps=0"))
    assert error == "Error: checkpoint.every_steps: must be a positive number of steps; got 0"
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize(("key", "value", "message"), [
    ("every_steps", -3, "checkpoint.every_steps: must be a positive number of steps; got -3"),
    ("keep_last", 0, "checkpoint.keep_last: must be >= 1 (the newest committed checkpoint is always kept); got 0"),
    ("export", True, "checkpoint.export: exports the final weights, which needs checkpoint.save_final=true"),
])
def test_each_bad_value_names_its_key(key: str, value, message: str) -> None:
    from hydra import compose, initialize_config_dir

    from trainflow.config.checks import check_config
    from trainflow.errors import ConfigError

    overrides = ["checkpoint=dcp", f"checkpoint.{key}={value}"] + (["checkpoint.save_final=false"] if key == "export"
                                                                    else [])
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with pytest.raises(ConfigError) as exc:
        check_config(cfg)
    assert str(exc.value) == message


@pytest.fixture
def copied(straight: Run, tmp_path: Path) -> Path:
    """A private copy of the reference run's checkpoints (step 8 and step 12) to damage."""
    dest = tmp_path / "ckpts"
    shutil.copytree(straight.run_dir / "checkpoints", dest)
    return dest


def test_resuming_a_finished_run_trains_nothing_and_says_so(copied: Path, run_dir: Path) -> None:
    before = tree_hash(copied)
    run = train(run_dir, *BASE, "checkpoint=dcp", f"checkpoint.dir={copied}", "trainer.max_steps=10")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the checkpoint is at step 12, trainer.max_steps is 10: nothing left to train" in run.stdout + run.stderr
    assert (run.summary["steps"], run.summary["steps_this_run"]) == (12, 0)
    assert tree_hash(copied) == before


def test_a_changed_learning_rate_on_resume_is_said_used_and_recorded(
        straight: Run, copied: Path, run_dir: Path) -> None:
    saved_lr = straight.summary["config"]["optim"]["lr"]
    run = train(run_dir, *BASE, "checkpoint=dcp", f"checkpoint.dir={copied}", "trainer.max_steps=14",
                f"optim.lr={saved_lr / 2}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (f"resume: optim.lr is {saved_lr / 2} in the config, {saved_lr} in the checkpoint; using the config's "
            f"{saved_lr / 2}") in run.stdout + run.stderr
    assert run.summary["checkpoint"]["resume_changes"] == [{"key": "optim.lr", "checkpoint": saved_lr,
                                                            "used": saved_lr / 2}]
    assert OmegaConf.load(run_dir / "config.yaml").optim.lr == saved_lr / 2
    assert run.summary["resumed_from_step"] == 12 and run.summary["steps"] == 14


def test_resume_never_or_an_older_path_refuses_to_mix_histories(copied: Path, tmp_path: Path) -> None:
    from trainflow.errors import ConfigError

    before = tree_hash(copied)
    for resume, message in (("never", r"checkpoint.resume=never: .* \(up to step_00000012\)"),
                            (str(copied / "step_00000008"), "checkpoint.resume: .* up to step_00000012")):
        ck = _checkpointer(tmp_path, dir=str(copied), resume=resume)
        with pytest.raises(ConfigError, match=message):
            ck.resume(_gpt_state())
        ck.close(_gpt_state())
    assert tree_hash(copied) == before


# ---------------------------------------------------------------------------------------------------------------
# in-process: the Checkpointer with a real model, optimizer and DCP files, no training process


def _state(seed: int = 0):
    from trainflow.checkpoint import TrainState
    from trainflow.models.mlp import MLP
    from trainflow.optim import build_optimizer

    torch.manual_seed(seed)
    model = MLP(in_features=8, hidden=16, out_features=4)
    optim_cfg = OmegaConf.create({"_target_": "torch.optim.AdamW", "lr": 1e-2, "weight_decay": 0.1,
                                  "betas": [0.9, 0.95], "warmup_steps": 2, "min_lr_ratio": 0.1, "schedule": "cosine"})
    optimizer, scheduler = build_optimizer(model, typed_section("optim", optim_cfg), 100, torch.device("cpu"))
    return TrainState(model, optimizer, scheduler)


def _gpt_state():
    """The model of the reference run (BASE), untrained."""
    from trainflow.checkpoint import TrainState
    from trainflow.models.gpt import GPT
    from trainflow.optim import build_optimizer

    model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
    optim_cfg = OmegaConf.create({"_target_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.1,
                                  "betas": [0.9, 0.95], "warmup_steps": 2, "min_lr_ratio": 0.1, "schedule": "cosine"})
    return TrainState(model, *build_optimizer(model, typed_section("optim", optim_cfg), 12, torch.device("cpu")))


def _step(state) -> None:
    x = torch.randn(4, 8)
    state.model(x).square().mean().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad()
    state.step += 1
    state.samples_seen += 4


def _checkpointer(tmp_path: Path, **overrides):
    from trainflow.checkpoint import Checkpointer
    from trainflow.config.schema import CheckpointConfig
    from trainflow.distributed import DistEnv

    cfg = CheckpointConfig(**{"enabled": True, "mode": "sync", "dir": str(tmp_path / "ckpts"), "every_steps": 1,
                              "keep_last": 3, "resume": "auto", "save_final": True, "verify": True, "export": False,
                              "load": "all",
                              **overrides})
    return Checkpointer(cfg, DistEnv(0, 1, 0, torch.device("cpu")), tmp_path)


def test_retention_under_many_saves_keeps_the_newest_and_the_resumed_one(tmp_path: Path) -> None:
    state, ck = _state(), _checkpointer(tmp_path, mode="async")
    ck.resume(state)
    for _ in range(25):
        _step(state)
        ck.after_step(state)
    ck.close(state)
    ckpts = tmp_path / "ckpts"
    assert committed(ckpts) == ["step_00000023", "step_00000024", "step_00000025"]
    assert entries(ckpts) == committed(ckpts)  # no leftovers of deletions or saves
    assert ck.summary()["saves"] == 25

    # a second run resumes from step 25 and keeps only 1: the resumed one survives beside the newest
    resumed, ck2 = _state(seed=1), _checkpointer(tmp_path, keep_last=1)
    ck2.resume(resumed)
    assert resumed.step == 25 and resumed.samples_seen == 100
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.state_dict().values(),
                                                 state.model.state_dict().values(), strict=True))
    for _ in range(4):
        _step(resumed)
        ck2.after_step(resumed)
    ck2.close(resumed)
    assert committed(ckpts) == ["step_00000025", "step_00000029"]


def test_listing_and_resume_ignore_unfinished_saves(tmp_path: Path) -> None:
    from trainflow.checkpoint import list_committed

    state, ck = _state(), _checkpointer(tmp_path)
    ck.resume(state)
    _step(state)
    ck.after_step(state)
    ck.close(state)
    ckpts = tmp_path / "ckpts"
    shutil.copytree(ckpts / "step_00000001", ckpts / ".tmp-step_00000002")  # a crashed save, all files present
    (ckpts / ".tmp-step_00000002" / "manifest.json").unlink()
    (ckpts / ".tmp-step_00000002" / TMP_MARKER).write_text("made by trainflow")  # what a save writes first
    assert [c.step for c in list_committed(ckpts)] == [1]

    fresh, ck2 = _state(seed=2), _checkpointer(tmp_path)
    ck2.resume(fresh)
    assert fresh.step == 1
    assert not (ckpts / ".tmp-step_00000002").exists()
    ck2.close(fresh)


def test_async_and_sync_saves_hold_equal_tensors(tmp_path: Path) -> None:
    state = _state()
    for _ in range(3):
        _step(state)
    for mode in ("sync", "async"):
        ck = _checkpointer(tmp_path / mode, mode=mode, every_steps=3)
        ck.resume(state)
        ck.after_step(state)
        ck.close(state)
    assert_same_tensors(tmp_path / "sync" / "ckpts" / "step_00000003", tmp_path / "async" / "ckpts" / "step_00000003")
