"""compare's judgement on real numbers, without a run: the steps' device time as the meter takes it, `superiority`,
`judge` (the least band, the confidence, the run-to-run floor), the ledger's run-to-run floor, and one figure's row
(which way is better, the runs' own figures, "cannot tell" with too few intervals, a busy machine judged on the own
step time, a change only the load explains). Each test fails when one line of what it covers changes (a constant,
a comparison, a direction)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from trainflow.loop.meter import PeakMemory, Throughput
from trainflow.loop.state import LoopState
from trainflow.metrics.noise import judge, superiority
from trainflow.report.causes import Note
from trainflow.report.compare import (
    BUSY_RUN_TO_RUN,
    FIGURE_NAMES,
    NOT_JUDGED_BUSY,
    ONLY_LOAD,
    OTHER_THREADS,
    RUN_TO_RUN,
    SPINNING,
    judge_figure,
    run_to_run,
)
from trainflow.report.gates import WARN, evaluate_gate, parse_gate
from trainflow.report.sides import RunView

# five intervals of one run: 10 ms give or take 1% (a spread of about 0.8%)
STEADY = [0.0099, 0.0100, 0.0100, 0.0101, 0.0100]


def scaled(values: list[float], factor: float) -> list[float]:
    return [v * factor for v in values]


def spin(cpu_s: float) -> None:
    """Work: `cpu_s` of this process's CPU time."""
    start = time.process_time()
    while time.process_time() - start < cpu_s:
        pass


def test_the_device_time_counts_a_steps_cpu_and_not_its_waits_nor_a_stage_that_paused() -> None:
    """Steady steps that compute 20 ms (odd) or wait 20 ms (even); a stage computes 50 ms after step 4 and says
    so (a pause): the device time is the mean CPU time of the steps less step 5 (which holds the stage's work); each
    step's wall time is at least the 20 ms it took."""
    cpu = torch.device("cpu")
    meter = Throughput(1, cpu, PeakMemory(cpu))
    state = LoopState(nn.Linear(1, 1), None, None)
    meter.begin()
    for step in range(1, 8):
        state.steps_this_run, state.data_wait_s = step, 0.0
        spin(0.02) if step % 2 else time.sleep(0.02)
        meter.end_step(state, samples=64, tokens=0)
        if step == 4:
            start = time.perf_counter()
            spin(0.05)
            meter.pause(time.perf_counter() - start)
    meter.stop()
    steady = meter.steady_state()
    assert steady["steps"] == 6 and steady["step_time_device_of"] == "process CPU time"
    device = meter.single.take()
    assert len(device) == 5  # steps 2, 3, 4, 6, 7
    assert [value > 0.015 for value in device] == [False, True, False, False, True]
    assert 0.04 / 5 <= steady["step_time_device_s"] < 0.04 / 5 * 1.5
    assert steady["step_time_device_s"] == sum(device) / 5
    assert steady["step_time_p10_s"] >= 0.02


def test_superiority_counts_the_pairs_b_wins_and_half_the_ties() -> None:
    assert superiority([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == 1.0
    assert superiority([4.0, 5.0, 6.0], [1.0, 2.0, 3.0]) == 0.0
    assert superiority([1.0, 2.0], [1.0, 2.0]) == 0.5
    assert superiority([1.0, 2.0], [2.0, 3.0]) == 0.875  # b=2: beats 1, ties 2 (1.5); b=3: beats both (2); of 4
    assert superiority([1.0, 3.0, 5.0], [2.0, 4.0]) == pytest.approx(3 / 6)


def test_judge_calls_a_change_beyond_the_floor_and_not_one_within_it() -> None:
    """The run-to-run floor (RUN_TO_RUN): a 12% slower step is within it, a 20% slower one is not."""
    within = judge(STEADY, scaled(STEADY, 1.12), 0.05, floor=RUN_TO_RUN)
    assert within.direction == 0 and within.band == RUN_TO_RUN and within.confidence == 1.0
    beyond = judge(STEADY, scaled(STEADY, 1.20), 0.05, floor=RUN_TO_RUN)
    assert beyond.direction == 1 and beyond.change == pytest.approx(0.20) and beyond.confidence == 1.0
    faster = judge(STEADY, scaled(STEADY, 0.80), 0.05, floor=RUN_TO_RUN)
    assert faster.direction == -1 and faster.confidence == 1.0  # the confidence of a decrease: A's wins


def test_judge_never_calls_a_change_below_the_least_band() -> None:
    """Tight intervals (bands under 1%) and no floor: 1.5% is below MIN_BAND (2%), 3% is beyond it."""
    assert judge(STEADY, scaled(STEADY, 1.015), 0.05).direction == 0
    moved = judge(STEADY, scaled(STEADY, 1.03), 0.05)
    assert moved.direction == 1 and moved.band == pytest.approx(0.02)


def test_judge_needs_the_confidence_of_nine_pairs_in_ten() -> None:
    """A 30% larger median beyond every band, but intervals that overlap: one of B's five below all of A's gives
    20 of 25 pairs (0.8: the same); with it between A's values, 22.5 of 25 (0.9: slower)."""
    a = [1.0, 1.0, 1.0, 1.0, 1.0]
    overlapping = judge(a, [0.9, 1.3, 1.3, 1.3, 1.3], 0.05, spreads=(0.01, 0.01))
    assert overlapping.confidence == pytest.approx(0.8) and overlapping.change == pytest.approx(0.3)
    assert overlapping.direction == 0
    tied = judge(a, [1.0, 1.3, 1.3, 1.3, 1.3], 0.05, spreads=(0.01, 0.01))
    assert tied.confidence == pytest.approx(0.9) and tied.direction == 1


def test_judge_takes_the_sides_own_values_for_the_change() -> None:
    """The change is of the runs' own figures (their summaries'), the intervals give the noise."""
    judged = judge(STEADY, scaled(STEADY, 1.5), 0.05, floor=RUN_TO_RUN, values=(0.011, 0.016))
    assert judged.change == pytest.approx(0.016 / 0.011 - 1) and judged.direction == 1


def line(median: float, busy: bool = False, host: str = "h", config: str = "c1") -> dict:
    return {"fingerprint": {"config_hash": config, "host": host, "device": {"type": "cpu"},
                            "load": {"busy": busy}, "step_time": {"median": median}}}


def view(step_time: float, device: float | None = None, busy: bool = False, intervals: int = 5, spread: float = 1.0,
         tmp: Path | None = None, other_cores: float = 0.0, config: str = "c1") -> RunView:
    """A run from its folder: its summary's figures, a fingerprint, and `intervals` log intervals about its figures."""
    device = device if device is not None else step_time * 0.9
    wobble = [1 - 0.01 * spread, 1.0, 1.0, 1 + 0.01 * spread, 1.0][:intervals]
    figures = {"step_time_s": step_time, "step_time_device_s": device, "samples_per_sec": 64 / step_time,
               "steps": 100}
    fingerprint = {"config_hash": config, "host": "h", "device": {"type": "cpu"},
                   "load": {"busy": busy, "other_cores": other_cores, "cpu_cores": 2},
                   "replay": {"env": {"OMP_NUM_THREADS": "1"}}}  # one thread: its CPU time is its work
    return RunView("run", tmp or Path("run"), figures, fingerprint, {"trainer": {"log_every": 10}},
                   {"step_time_s": scaled(wobble, step_time), "step_time_device_s": scaled(wobble, device),
                    "samples_per_sec": scaled(wobble, 64 / step_time)}, steady_from=5)


def test_the_ledger_floor_is_the_spread_of_a_configs_idle_runs_on_one_host() -> None:
    """Three idle runs of the config on this host and device: their medians' spread; fewer, or busy ones, or
    another host's, do not count, and the default floor is used."""
    history = [line(1.0), line(1.1), line(1.2), line(5.0, busy=True), line(9.0, host="other"),
               line(7.0, config="c2")]
    floor, source = run_to_run([view(1.0)], [view(1.0)], history, None)
    assert floor == pytest.approx(0.16 / 2 / 1.1) and source == "run to run, 3 runs of the ledger"
    assert run_to_run([view(1.0)], [view(1.0)], history[1:], None) == (RUN_TO_RUN, "run to run, default")
    assert run_to_run([view(1.0)], [view(1.0)], history, 0.03) == (0.03, "--min-band")


def row(a: RunView, b: RunView, name: str, found: list[Note] | None = None) -> dict:
    return judge_figure(FIGURE_NAMES[name], [a], [b], found or [], (RUN_TO_RUN, "run to run, default"))


def test_a_longer_step_is_slower_and_worse_and_fewer_samples_per_second_are_too() -> None:
    """Step time: higher is worse; samples/s: higher is better. The figures shown are the runs' own."""
    a, b = view(0.010), view(0.015)
    step = row(a, b, "step_time")
    assert (step["a"], step["b"]) == (0.010, 0.015) and step["judged_on"] == "step_time"
    assert step["verdict"] == "slower" and step["better"] is False and step["confidence"] == 1.0
    throughput = row(a, b, "samples_per_sec")
    assert throughput["verdict"] == "slower" and throughput["better"] is False
    back = row(b, a, "step_time")
    assert back["verdict"] == "faster" and back["better"] is True


def test_too_few_intervals_cannot_tell(tmp_path: Path) -> None:
    """Two steady intervals (a 30-step run logging every 10, its steady state from step 5): no verdict, however
    far apart; the steps it would need: intervals from step 10, three of them."""
    a, b = view(0.010, intervals=2, tmp=tmp_path), view(0.020, intervals=2, tmp=tmp_path)
    step = row(a, b, "step_time")
    assert step["verdict"] == "cannot tell: 2 intervals; run at least 40 steps" and step["better"] is None
    assert step["undecided"] == step["verdict"] and step["likely_cause"] is None
    assert row(a, view(0.020, tmp=tmp_path), "step_time")["verdict"].startswith("cannot tell: 2 intervals")
    gate = evaluate_gate(parse_gate("step_time=+5%", {"step_time": 1}),
                         {"a": ["a"], "b": ["b"], "figures": [step]})
    assert gate["status"] == WARN and "cannot tell: 2 intervals" in gate["detail"]


def test_a_busy_machine_judges_the_step_time_on_its_device_time_and_not_the_wall_figures() -> None:
    """A busy B: its wall step time doubled, its device time did not move: the step time is the same (judged on its
    device time, and its label says so); samples/s (wall time) is not judged. Runs with other thread counts have
    CPU times that do not compare: their step time is not judged either."""
    a, b = view(0.010, device=0.008), view(0.020, device=0.008, busy=True, other_cores=1.0)
    step = row(a, b, "step_time")
    assert step["judged_on"] == "step_time_device" and (step["a"], step["b"]) == (0.008, 0.008)
    assert step["verdict"] == "same" and "its device time: a busy machine" in step["label"]
    # the device time's floor on a busy machine (100%): 95% more is within it, 105% more is not
    assert row(a, view(0.020, device=0.008 * 1.95, busy=True), "step_time")["verdict"] == "same"
    slower = row(a, view(0.020, device=0.008 * 2.05, busy=True), "step_time")
    assert slower["verdict"] == "slower" and slower["band"] == BUSY_RUN_TO_RUN
    assert slower["band_from"] == "run to run on a busy machine"
    throughput = row(a, b, "samples_per_sec")
    assert throughput["verdict"] == NOT_JUDGED_BUSY and throughput["better"] is None and throughput["busy_only"]
    assert row(view(0.010, device=0.008), view(0.020, device=0.008), "step_time")["judged_on"] == "step_time"  # idle
    b.fingerprint["replay"] = {"env": {"OMP_NUM_THREADS": "2"}}
    threads = row(a, b, "step_time")
    assert threads["judged_on"] == "step_time" and threads["verdict"] == NOT_JUDGED_BUSY
    assert row(a, b, "step_time_device")["verdict"] == OTHER_THREADS
    for run in (a, b):
        run.fingerprint["device"] = {"type": "cuda"}  # a GPU's time: threads do not count
    assert row(a, b, "step_time")["judged_on"] == "step_time_device"


def test_a_busy_machine_with_torchs_threads_spinning_judges_no_step_time() -> None:
    """CPU runs with more than one intra-op thread (OMP_NUM_THREADS unset: a thread per core) on a busy machine:
    their CPU time counts the threads' spinning while another process holds a core, so neither it nor the wall time
    is judged, and the row says how to get a verdict; idle, the step time is judged as always."""
    a, b = view(0.010, device=0.008), view(0.030, device=0.024, busy=True, other_cores=0.8)
    for run in (a, b):
        run.fingerprint["replay"] = {"env": {}}
    step = row(a, b, "step_time")
    assert step["verdict"] == SPINNING and step["better"] is None and step["busy_only"]
    assert step["judged_on"] == "step_time" and "OMP_NUM_THREADS=1" in step["verdict"]
    b.fingerprint["load"]["busy"] = False
    assert row(a, b, "step_time")["verdict"] == "slower"  # idle: the wall time, judged


def test_a_change_only_the_load_explains_is_neither_slower_nor_faster() -> None:
    """Its device time moved too, and the fingerprints differ only in the load: no verdict, the load named; another
    config beside it is the cause, and the verdict stands."""
    a, b = view(0.010, device=0.008), view(0.030, device=0.020, busy=True, other_cores=1.5)
    load = Note("machine load", "B ran on a busier machine: ...", speed_only=True)
    step = row(a, b, "step_time", [load])
    assert step["verdict"] == ONLY_LOAD and step["better"] is None and step["busy_only"]
    assert step["likely_cause"] == load.text
    config = Note("config", "another config: model.hidden: 256 -> 1024")
    judged = row(a, b, "step_time", [config, load])
    assert judged["verdict"] == "slower" and judged["better"] is False and judged["likely_cause"] == config.text
