"""TensorBoard as the dashboard: two runs and a 2-job sweep, read back with TensorBoard's own reader and plugins.

The HParams checks ask TensorBoard's hparams plugin backend what its HPARAMS tab shows (the experiment: which
hyperparameters and metrics, and the session groups with their values), over event files real runs wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.processes import run_process
from helpers.runs import ROOT, TINY_GPT, train

from trainflow.config.schema import TrainerConfig

TB_GPT = [o for o in TINY_GPT if o != "logger=none"] + ["logger=tensorboard", "trainer.eval_steps=1"]
MIB = 2**20


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs side by side, as `outputs/` holds them: a long one with the default settings, and a short one
    that overrides the learning rate and profiles."""
    root = tmp_path_factory.mktemp("outputs")
    long = train(root / "long", *TB_GPT, "trainer.max_steps=100", "trainer.log_every=25")
    assert long.returncode == 0, long.stderr[-3000:]
    short = train(root / "short", *TB_GPT, "trainer.max_steps=6", "optim.lr=3e-4", "profiler=schedule",
                  "profiler.wait=0", "profiler.warmup=1", "profiler.active=2")
    assert short.returncode == 0, short.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python train.py -m optim.lr=1e-3,3e-4 ...`: two jobs in one sweep folder."""
    folder = tmp_path_factory.mktemp("multirun") / "sweep"
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", *TB_GPT, "trainer.max_steps=4",
                        "optim.lr=1e-3,3e-4", f"hydra.sweep.dir={folder}"], ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


def hparams_tab(logdir: Path) -> tuple[dict, dict]:
    """What TensorBoard's HPARAMS tab gets for `tensorboard --logdir logdir`: the experiment's hyperparameters
    ({name: differs}) and metrics, and each session group's hyperparameters, metric values and statuses."""
    from google.protobuf import json_format
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment, list_session_groups
    from tensorboard.plugins.scalar.scalars_plugin import ScalarsPlugin

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    plugins: dict = {}
    tb = base_plugin.TBContext(logdir=str(logdir), multiplexer=mux, plugin_name_to_instance=plugins,
                               data_provider=data_provider.MultiplexerDataProvider(mux, str(logdir)))
    plugins["scalars"] = ScalarsPlugin(tb)  # the HParams tab reads metric values through it
    backend, request = backend_context.Context(tb), context.RequestContext()
    exp = get_experiment.Handler(request, backend, "", api_pb2.GetExperimentRequest(include_metrics=True)).run()
    columns = ([api_pb2.ColParams(hparam=h.name) for h in exp.hparam_infos]
               + [api_pb2.ColParams(metric=m.name) for m in exp.metric_infos])
    groups = list_session_groups.Handler(request, backend, "", api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=100, col_params=columns, aggregation_type=api_pb2.AGGREGATION_AVG,
        allowed_statuses=[api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE,
                          api_pb2.STATUS_RUNNING])).run()
    experiment = {"hparams": {h.name: h.differs for h in exp.hparam_infos},
                  "metrics": sorted(m.name.tag for m in exp.metric_infos)}
    sessions = {g.name: {"hparams": {k: json_format.MessageToDict(v) for k, v in g.hparams.items()},
                         "metrics": {m.name.tag: m.value for m in g.metric_values},
                         "status": [api_pb2.Status.Name(s.status) for s in g.sessions]}
                for g in groups.session_groups}
    return experiment, sessions


def events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={TENSORS: 0})  # 0: keep every record
    accumulator.Reload()
    return accumulator


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_two_runs_compare_in_the_hparams_tab(outputs: Path) -> None:
    experiment, sessions = hparams_tab(outputs)
    assert set(sessions) == {"long/tensorboard", "short/tensorboard"}
    assert experiment["hparams"]["optim.lr"] is True  # what differs comes first in the tab
    assert experiment["hparams"]["model.n_embd"] is False
    assert {"summary/val_loss", "summary/samples_per_sec", "summary/mfu", "summary/peak_memory_mib",
            "loss/train", "loss/val"} <= set(experiment["metrics"])
    short, long = sessions["short/tensorboard"], sessions["long/tensorboard"]
    assert short["hparams"]["optim.lr"] == 3e-4 and long["hparams"]["optim.lr"] == 1e-3  # typed, and default
    assert "profiler.wait" in short["hparams"] and "profiler.wait" not in long["hparams"]  # typed only
    assert short["hparams"]["profiler"] == "schedule" and long["hparams"]["profiler"] == "off"  # group choices
    assert short["hparams"]["trainer.max_steps"] == 6
    assert long["hparams"]["trainer.max_steps"] == 100 and long["hparams"]["model"] == "gpt_tiny"
    for name, session in sessions.items():
        s = summary(outputs / name.split("/")[0])
        m = session["metrics"]
        assert session["status"] == ["STATUS_SUCCESS"]
        assert m["summary/val_loss"] == pytest.approx(s["validation"]["loss"], rel=1e-6)  # TensorBoard stores fp32
        assert m["summary/val_perplexity"] == pytest.approx(s["validation"]["perplexity"], rel=1e-6)
        assert m["summary/samples_per_sec"] == pytest.approx(s["steady_state"]["samples_per_sec"], rel=1e-6)
        assert m["summary/mfu"] == pytest.approx(s["mfu"], rel=1e-6)
        assert m["summary/peak_memory_mib"] == pytest.approx(s["peak_memory_bytes"] / MIB, rel=1e-6)
        assert m["loss/val"] == pytest.approx(s["validation"]["loss"], rel=1e-6)  # the last evaluation is the final one


def test_sweep_jobs_are_named_by_their_swept_values(sweep: Path) -> None:
    experiment, sessions = hparams_tab(sweep)
    assert set(sessions) == {"0/tensorboard/optim.lr=0.001", "1/tensorboard/optim.lr=0.0003"}
    assert sessions["0/tensorboard/optim.lr=0.001"]["hparams"]["optim.lr"] == 1e-3
    assert sessions["1/tensorboard/optim.lr=0.0003"]["hparams"]["optim.lr"] == 3e-4
    assert [k for k, differs in experiment["hparams"].items() if differs] == ["optim.lr"]
    for name, session in sessions.items():
        assert session["metrics"]["summary/val_loss"] == pytest.approx(
            summary(sweep / name.split("/")[0])["validation"]["loss"], rel=1e-6)
    report = json.loads((sweep / "report.json").read_text())  # the event folders are not taken for runs
    assert [row["name"] for row in report["runs"]] == ["0", "1"]


def test_config_and_profiler_verdict_are_text(outputs: Path) -> None:
    run_dir = outputs / "short"
    tb = events(run_dir / "tensorboard")
    assert set(tb.PluginTagToContent("text")) == {"config", "profiler"}
    config = tb.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert config == f"```yaml\n{(run_dir / 'config.yaml').read_text()}```"
    profiler = summary(run_dir)["profiler"]
    record = tb.Tensors("profiler")[0]
    text = record.tensor_proto.string_val[0].decode()
    assert record.step == 6
    assert f"): {profiler['verdict']['bound']}" in text and profiler["verdict"]["action"] in text
    for op in profiler["top_ops"]:
        assert f"| `{op['name']}` | {op['calls_per_step']} | {op['self_ms_per_step']:.3f} |" in text
    assert "ui.perfetto.dev" in text and profiler["traces"][0] in text
    assert "profiler" not in events(outputs / "long" / "tensorboard").PluginTagToContent("text")  # none: no text


def test_loss_comes_first_and_memory_is_a_peak_in_mib(outputs: Path) -> None:
    run_dir = outputs / "long"
    tb = events(run_dir / "tensorboard")
    tags = tb.Tags()["scalars"]
    groups = sorted({t.split("/")[0] for t in tags})
    assert groups[:2] == ["loss", "perf"]  # TensorBoard opens the first two groups, sorted by name
    assert "perf/memory_bytes" not in tags
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "train/loss" in r]
    assert [e.value for e in tb.Scalars("perf/peak_memory_mib")] == pytest.approx(
        [r["perf/memory_bytes"] / MIB for r in logged], rel=1e-6)
    assert [(e.step, e.value) for e in tb.Scalars("loss/train")] == [
        (r["step"], pytest.approx(r["train/loss"], rel=1e-6)) for r in logged]


def test_validation_is_a_curve_by_default_in_long_runs(outputs: Path) -> None:
    """eval_every=auto: 10 evaluations in a 100-step run; a 6-step run evaluates once, at its end."""
    val_steps = [e.step for e in events(outputs / "long" / "tensorboard").Scalars("loss/val")]
    assert val_steps == list(range(10, 101, 10))
    assert [e.step for e in events(outputs / "short" / "tensorboard").Scalars("loss/val")] == [6]
    jsonl = [json.loads(line) for line in (outputs / "long" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl if "val/loss" in r] == val_steps


@pytest.mark.parametrize(("max_steps", "eval_every", "interval"),
                         [(100, "auto", 10), (1000, "auto", 100), (99, "auto", 0), (6, "auto", 0), (100, 7, 7),
                          (100, 0, 0)])
def test_eval_interval(max_steps: int, eval_every: int | str, interval: int) -> None:
    assert TrainerConfig(max_steps=max_steps, eval_every=eval_every).eval_interval() == interval


def test_hyperparameters_keep_their_types() -> None:
    """Numbers stay numbers and bools bools (TensorBoard filters and charts them so); the rest is its text."""
    from trainflow.config.schema import OptimConfig
    from trainflow.loggers import headline, hyperparameters

    trainer, optim = TrainerConfig(batch_size=8, max_steps=20, precision="fp32"), OptimConfig(lr=3e-4)
    choices = {"model": "gpt_tiny", "experiment": None, "hydra/launcher": "basic"}
    values = hyperparameters(headline(trainer, optim), choices,
                             ["optim.lr=3e-4", "trainer.deterministic=true", "data.paths=[/a,/b]",
                              "checkpoint.dir=null", "+extra.flag=false", "~metrics.peak_flops"])
    assert values == {"model": "gpt_tiny", "optim.lr": 3e-4, "trainer.batch_size": 8, "trainer.max_steps": 20,
                      "trainer.precision": "fp32", "trainer.deterministic": True, "data.paths": "[/a,/b]",
                      "checkpoint.dir": "null", "extra.flag": False, "metrics.peak_flops": "(deleted)"}
    from tensorboard.plugins.hparams import metadata

    from trainflow.loggers.tensorboard import session_start_record

    record = session_start_record(values).value[0]
    stored = metadata.parse_session_start_info_plugin_data(record.metadata.plugin_data.content).hparams
    assert record.tag == "_hparams_/session_start_info"
    assert stored["trainer.deterministic"].bool_value is True and stored["extra.flag"].HasField("bool_value")
    assert stored["optim.lr"].number_value == 3e-4 and stored["data.paths"].string_value == "[/a,/b]"


def test_a_job_name_is_cut_at_200_bytes_between_characters() -> None:
    from trainflow.loggers import folder_name

    greek = "trainer.run_name=" + "α" * 300  # 2 bytes a character: 200 characters would be 383 bytes
    cut = folder_name(greek)
    assert len(cut.encode()) == 199 and greek.startswith(cut)  # 200 would split an α: one byte less
    assert folder_name("a" * 300) == "a" * 200 and folder_name("short") == "short"


def test_a_sweep_of_long_non_ascii_values_names_its_jobs_within_a_file_names_bytes(tmp_path: Path) -> None:
    """Swept values whose job name has more than 255 bytes (non-ASCII): each job's TensorBoard folder is named by
    the first 200 bytes of it, and the jobs run."""
    values = ["1" + "α" * 150, "2" + "α" * 150]
    folder = tmp_path / "sweep"
    proc = run_process([sys.executable, str(ROOT / "train.py"), "-m", *TB_GPT, "trainer.max_steps=2",
                        "trainer.run_name=" + ",".join(f"'{v}'" for v in values), f"hydra.sweep.dir={folder}"], ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for job, value in enumerate(values):
        (events,) = (folder / str(job) / "tensorboard").iterdir()
        (swept,) = [o for o in (folder / str(job) / ".hydra" / "overrides.yaml").read_text().splitlines()
                    if "trainer.run_name=" in o]
        name = swept.removeprefix("- ")  # the job's override as Hydra saved it, its value quoted or not
        assert value in name and len(name.encode()) > 255
        assert len(events.name.encode()) <= 200 and name.startswith(events.name)
        assert list(events.glob("events.out.tfevents.*")) and summary(folder / str(job))["steps"] == 2
