"""Process-level behaviour of the entry points: what they register with Hydra, whether this process trains or
starts local workers that do, and user errors as one line and a non-zero exit."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainflow.checkpoint import export_weights, stop_exit_code
from trainflow.checkpoint.export import FORMATS
from trainflow.checkpoint.stopping import catch_stop_signals, release_stop_signals
from trainflow.checkpoint.store import resolve_dir
from trainflow.conf import CONFIG_PATH
from trainflow.config.checks import check_config
from trainflow.config.command_line import explain, raised_errors, single_run
from trainflow.config.compose import compose_run
from trainflow.config.schema import FaultToleranceConfig, TextDataConfig, register_configs
from trainflow.data.shards import prepare
from trainflow.data.text import Corpus
from trainflow.errors import (
    EXIT_COMMAND_LINE,
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    ConfigError,
    TrainflowError,
    print_error,
    traceback_wanted,
    user_error,
)
from trainflow.guards.fault_tolerance import serve_lighthouse
from trainflow.record import kept, sweep_outcome, sweeps
from trainflow.report import compare, ledger_list
from trainflow.report import runs as report
from trainflow.report.ladder import register_resolvers as register_ladder_resolvers
from trainflow.util.files import not_a_file
from trainflow.util.optional import torchft_installed
from trainflow.util.rank import env_rank
from trainflow.util.rundir import RUN_DIR_ENV, note_before, undo_refused
from trainflow.util.rundir import register_resolvers as register_run_dir_resolvers
from trainflow.util.shown import shown
from trainflow.util.targets import user_folder_importable


def register_with_hydra() -> None:
    """Put the config schemas and resolvers where Hydra finds them. Every entry point calls this before Hydra
    composes a config (train.py, the launchers' workers, tests): importing trainflow registers nothing."""
    register_configs()
    register_run_dir_resolvers()
    register_ladder_resolvers()
    sweeps.register_resolvers()


def check_config_dir(argv: list[str]) -> None:
    """Before Hydra composes: every .yaml file under `--config-dir DIR` (Hydra's option for a folder of one's own
    configs) must be a regular file of valid YAML. Hydra prints a syntax error as a traceback of some 90 lines, and
    would open a FIFO and wait forever; here either is one line naming the file (and the line and column)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config-dir", "-cd")
    folder = parser.parse_known_args(argv)[0].config_dir
    if folder is None or not Path(folder).is_dir():
        return  # none given, or Hydra's own one line for a folder that does not exist
    for root, _, names in sorted(os.walk(folder)):
        for path in sorted(Path(root) / n for n in names if n.endswith(".yaml")):
            if (problem := not_a_file(path)) is not None:
                user_error(f"--config-dir: {path} {problem}; Hydra would read it as a config: make it a YAML file, "
                           "or move it out of the folder")
            try:
                yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
            except (OSError, UnicodeDecodeError) as exc:
                user_error(f"--config-dir: {path} cannot be read as text ({exc}); fix or remove it")
            except yaml.MarkedYAMLError as exc:
                where = exc.problem_mark or exc.context_mark
                at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
                user_error(f"--config-dir: {path} is not valid YAML ({exc.problem or exc.context}{at}); fix the "
                           "file")


def run_from_hydra(cfg: DictConfig) -> float | None:
    """Run one training job for `train.py`; return the final validation value of task.monitor (what sweepers
    optimise, in the direction of task.mode)."""
    try:
        return _run_job(cfg)
    finally:
        release_stop_signals()


def _run_job(cfg: DictConfig) -> float | None:
    """The job: check the config, catch the stop signals, train here or start the local workers; user errors as one
    line."""
    from trainflow.run.launch import launch, should_launch  # lazy: ~50 ms the other commands need not pay
    from trainflow.run.training import train  # lazy: the loop's modules, ~60 ms the other commands need not pay

    user_folder_importable()  # a launcher's worker imports from the folder its sweep was started in
    hydra_cfg = HydraConfig.get()
    sweep_job = sweeps.is_sweep_job(hydra_cfg)
    try:
        run_cfg = sweeps.with_job_checkpoint_dir(check_config(cfg), hydra_cfg)  # typed once: the run reads this
        # from here on a stop signal says in one line what it did, whatever the run is doing (see stopping.py)
        catch_stop_signals(run_cfg.checkpoint.stop_signals, run_cfg.checkpoint.enabled, speak=env_rank() == 0)
        run_dir = Path(hydra_cfg.runtime.output_dir)
        if env_rank() == 0 and run_cfg.checkpoint.enabled:  # its lock's holder line goes back if this is refused
            note_before(resolve_dir(run_cfg.checkpoint.dir, run_dir), depth=1)
        earlier = kept.read_earlier(run_dir)
        if (done := kept.finished(earlier, run_cfg)) is not None:  # the same command again: its results stay
            if env_rank() == 0:
                line = sweep_outcome.skip_line(hydra_cfg.job.num, run_dir, done) if sweep_job else \
                    kept.finished_line(run_dir, done)
                print(line, flush=True)
            return sweep_outcome.monitor_value(done)
        fix = sweep_outcome.FRESH if sweep_job else \
            "give this run its own folder (trainer.run_name=<new name> or hydra.run.dir=<new folder>)"
        key = f"hydra.sweep.dir: job #{hydra_cfg.job.num}" if sweep_job else "hydra.run.dir"
        if (continued := kept.check_may_write(earlier, run_cfg, key, fix)) and env_rank() == 0:
            print(continued, flush=True)
        if sweep_job and sweeps.typed_checkpoint_dir(hydra_cfg) and run_cfg.checkpoint.enabled:
            sweeps.claim_checkpoint_dir(Path(str(run_cfg.checkpoint.dir)), sweeps.job_identity(hydra_cfg))
        # ddp/fsdp typed without torchrun: start the local workers, which train through `run` themselves
        summary = launch(run_cfg, run_dir) if should_launch(run_cfg) else train(run_cfg, run_dir)
    except TrainflowError as exc:
        if traceback_wanted():
            raise
        undo_refused()  # refused before training: nothing left on disk
        print_error(str(exc))
        if sweep_job and not os.environ.get(RUN_DIR_ENV):
            # Hydra's own launcher runs every job in this process: fail this job, not the sweep (Hydra runs the
            # rest, then exits non-zero naming the first failure)
            raise sweep_outcome.JobFailed(
                f"job #{hydra_cfg.job.num} failed (exit code {exc.exit_code}): {exc}") from None
        sys.exit(exc.exit_code)
    except SystemExit as exc:
        if exc.code == EXIT_USER_ERROR:  # a one-line refusal (user_error)
            undo_refused()
        raise
    except KeyboardInterrupt:
        if traceback_wanted():
            raise
        if env_rank() == 0:  # every rank gets the terminal's Ctrl-C: one line is enough
            print("Interrupted: stopped at once, without a save; committed checkpoints are untouched (a stop signal, "
                  "SIGTERM say, saves at the next step boundary, then stops)", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    if (code := stop_exit_code(summary)) is not None:  # saved on a stop signal: tell the launcher to run us again
        if env_rank() == 0 and single_run():
            print(f"Stopped after a committed checkpoint; to resume, run the same command: {resume_command()}",
                  file=sys.stderr)
        sys.exit(code)
    validation = summary.get("validation") if summary else None
    return validation.get(summary["task"]["monitor"]) if validation else None


def resume_command() -> str:
    """This process's command line, which resumes the run (its directory follows from it); a checkpoint.resume
    given to it is dropped: the run's own newest checkpoint is where to continue."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun: its options are not ours to see
        args = [a for a in sys.argv[1:] if not a.startswith("checkpoint.resume=")]
        return "torchrun <the same options> " + shlex.join([sys.argv[0], *args])
    return shlex.join(a for a in sys.orig_argv if not a.startswith("checkpoint.resume="))


def train(overrides: list[str]) -> None:
    """`trainflow train [overrides]` and `python -m trainflow train ...`: what `python train.py` does in a checkout,
    from any folder (the configs ship inside the package; outputs go under the working directory)."""
    check_config_dir(overrides)  # a broken YAML file or a FIFO of one's own: one line, before Hydra reads it
    register_with_hydra()
    sys.argv = [sys.argv[0], *overrides]  # Hydra reads its own options and the overrides from sys.argv
    try:
        with raised_errors():
            hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")(run_from_hydra)()
    except SystemExit as exc:
        if exc.code == EXIT_USER_ERROR:  # a sweep refused in one line (its launcher's settings, a ladder rung)
            undo_refused()
        raise
    except Exception as exc:
        if (line := None if traceback_wanted() else explain(exc, overrides)) is None:
            raise
        print_error(line)
        sys.exit(EXIT_COMMAND_LINE)


class StopSignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP raised where the program is, as Python raises KeyboardInterrupt on Ctrl-C, so that what a
    command began is undone on the way out (an export's staging folder)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise StopSignal instead of ending the process at once."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise StopSignal(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _export(args: argparse.Namespace) -> int:
    """Consolidate the model weights of a committed checkpoint (saved on any number of ranks, by any strategy) into
    one file or folder. Never writes inside a checkpoint folder; an existing output needs --force, and only an
    earlier export is replaced."""
    with stop_signals_raise():
        info = export_weights(args.checkpoint, args.out, args.format, force=args.force,
                              with_optimizer=args.with_optimizer, config=args.config, ema=args.ema)
    print(f"wrote {info['path']} ({info['format']}): {info['tensors']} tensors, {info['bytes'] / 1e6:.1f} MB, "
          f"the model of step {info['step']} ({info['checkpoint']})")
    return 0


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="a step_N folder, or a checkpoint dir / run dir (its newest)")
    p.add_argument("out", help="the file (torch: model.pt) or folder to write")
    p.add_argument("--format", choices=FORMATS, default="torch",
                   help="torch: one file for torch.load(path, weights_only=True); safetensors: a folder of "
                        "model.safetensors; hf: a Hugging Face folder (from_pretrained); dcp: a stock "
                        "torch.distributed.checkpoint folder")
    p.add_argument("--force", action="store_true", help="replace an existing file or earlier export at OUT")
    p.add_argument("--with-optimizer", action="store_true", help="dcp: the optimizer state too")
    p.add_argument("--ema", action="store_true", help="the average of the weights (stages=[ema]) in their place")
    p.add_argument("--config", type=Path, help="the run's config.yaml (default: <run dir>/config.yaml beside the "
                                                "checkpoint dir); hf needs it")


def _compare(args: argparse.Namespace) -> int:
    """Compare B with A: two run folders, two sweep folders, two ledger selections (ledger:config=HASH,last=5) or two
    checkpoints (a step_N folder, or a checkpoint dir for its newest). Writes compare.md, compare.json and compare.png
    to --out (default: the next free outputs/compare/N here; an earlier comparison is replaced only with --force) and
    prints every verdict; exit code 1 when a --fail-on gate fails. --bisect replays the runs with trainflow train in
    this Python and their overrides, printing each command first; a stop signal ends a replay with it."""
    with stop_signals_raise():
        return compare.command(args)


def _prepare(args: argparse.Namespace) -> int:
    """Tokenize the corpus of data=text (the same config keys as training) into memory-mapped token shards with a
    manifest of checksums; run again to finish an interrupted prepare, or to write damaged or missing shards again."""
    try:
        register_with_hydra()
        data = OmegaConf.to_container(compose_run(args.overrides, args.config_dir).data, resolve=True)
        if data.get("_target_") != TextDataConfig._target_:
            raise ConfigError("data: trainflow prepare reads a corpus of text files; give data=text data.paths=[...] "
                              "(and the tokenizer= the run will train with)")
        corpus = Corpus.of(data)
        tokenizer = corpus.tokenizer(data["tokenizer"])
        # what the data depends on (not --workers): a message about a damaged shard gives it to run again
        config_dir = ["--config-dir", str(args.config_dir.resolve())] if args.config_dir else []
        command = ["trainflow", "prepare", "--out", str(args.out), "--shard-mb", f"{args.shard_mb:g}", *config_dir,
                   *args.overrides]
        done = prepare(corpus, tokenizer, args.out, args.workers, int(args.shard_mb * (1 << 20)),
                       progress=not args.quiet, command=command)
    except KeyboardInterrupt:
        print(f"Interrupted: trainflow prepare stopped; the shards it finished in {args.out} are kept: run the same "
              "command to prepare the rest", file=sys.stderr)
        return EXIT_INTERRUPTED
    manifest, kept = done.manifest, len(done.manifest["shards"]) - done.written
    whole = f" ({kept} already there and whole: checksums checked)" if kept else ""
    print(f"wrote {done.written} of {len(manifest['shards'])} shards{whole}, {manifest['tokens']} tokens "
          f"({manifest['dtype']}, tokenizer {manifest['tokenizer']}) to {args.out}; train with data=shards "
          f"data.path={args.out} model.vocab_size={manifest['vocab_size']}")
    return 0


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="the folder to write the shards and manifest.json to")
    p.add_argument("--workers", type=int, default=1, help="processes that tokenize shards in parallel")
    p.add_argument("--shard-mb", type=float, default=64, help="text a shard holds, about (MB)")
    p.add_argument("--config-dir", type=Path, help="a folder of your own config groups, searched before trainflow's "
                                                   "(as trainflow train --config-dir)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.paths=[corpus/] tokenizer=bpe")


def _lighthouse(args: argparse.Namespace) -> int:
    """Run torchft's lighthouse here, in the foreground, for replica groups of parallelism.fault_tolerance=torchft on
    any hosts: give every job parallelism.ft.lighthouse=http://THIS_HOST:PORT. Ctrl-C stops it; with --idle-s it
    stops once no group has talked to it that long."""
    if not torchft_installed():
        raise ConfigError("trainflow lighthouse: torchft is not installed: pip install 'trainflow[ft]'")
    try:
        serve_lighthouse(args.port, args.min_replicas, args.join_timeout_s, args.heartbeat_timeout_s, args.idle_s)
    except KeyboardInterrupt:
        print("trainflow lighthouse: stopped", file=sys.stderr)
    return 0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0; got {text}")
    return value


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {text}")
    return value


def _lighthouse_arguments(p: argparse.ArgumentParser) -> None:
    ft = FaultToleranceConfig()  # the defaults lighthouse=auto starts one with
    p.add_argument("--port", type=int, default=ft.lighthouse_port, help="where to listen (default %(default)s)")
    p.add_argument("--min-replicas", type=_at_least_one, default=ft.min_replicas,
                   help="the fewest replica groups a step trains with (parallelism.ft.min_replicas)")
    p.add_argument("--heartbeat-timeout-s", type=_positive, default=ft.heartbeat_timeout_s,
                   help="a group silent this long is left out of the next quorum")
    p.add_argument("--join-timeout-s", type=_positive, default=ft.join_timeout_s,
                   help="how long a quorum waits for a live group that has not asked")
    p.add_argument("--idle-s", type=_positive, default=None,
                   help="stop once no group has talked to it this long (default: run until stopped)")


@dataclass(frozen=True)
class Subcommand:
    """`trainflow <name>`: a one-line help, what adds its arguments, and the handler (args -> exit code), whose
    docstring is the command's description; `interrupted`: what is left when it is stopped by a signal."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]
    interrupted: str = ""


def subcommands() -> list[Subcommand]:
    return [Subcommand("export", "write a committed checkpoint's model weights for other tools", _export_arguments,
                       _export, "; the output is as it was, and nothing of this export is left"),
            Subcommand("report", "compare the runs under a folder: report.md, report.json, report.png",
                       report.add_arguments, report.command),
            Subcommand("compare", "compare two runs, sweeps, ledger selections or checkpoints with their noise; "
                       "--fail-on gates, --bisect", compare.add_arguments, _compare,
                       "; a --bisect replay it started is stopped with it"),
            Subcommand("ledger", "list and filter the ledger of finished runs", ledger_list.add_arguments,
                       ledger_list.command),
            Subcommand("prepare", "tokenize a corpus once into token shards for data=shards", _prepare_arguments,
                       _prepare),
            Subcommand("lighthouse", "run torchft's lighthouse for parallelism.fault_tolerance=torchft replica groups",
                       _lighthouse_arguments, _lighthouse)]


def main(argv: list[str] | None = None) -> None:
    """The `trainflow` console command and `python -m trainflow`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["train"], ["export"], ["prepare"]):  # the commands that build your code import it from here
        user_folder_importable()
    if argv[:1] == ["train"]:  # Hydra owns every argument after `train` (-m, --cfg, --config-dir, overrides)
        train(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="trainflow", description="trainflow: train, and tools for runs and "
                                                                   "checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    commands.add_parser("train", help="train: trainflow train [group=option ...] [key=value ...] (Hydra's "
                                      "options too: -m, --cfg job, --config-dir, --help)", add_help=False)
    for command in subcommands():
        p = commands.add_parser(command.name, help=command.help, description=inspect.getdoc(command.handler))
        command.add_arguments(p)
        p.set_defaults(subcommand=command)
    args = parser.parse_args(argv)
    try:
        code = args.subcommand.handler(args)
    except TrainflowError as exc:
        if traceback_wanted():
            raise
        print_error(shown(str(exc)))  # a name from a received file (a run folder, a ledger) stays on this one line
        code = exc.exit_code
    except KeyboardInterrupt as exc:
        if traceback_wanted():
            raise
        signum = exc.signum if isinstance(exc, StopSignal) else signal.SIGINT
        name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"Interrupted: trainflow {args.command} stopped by {name}{args.subcommand.interrupted}",
              file=sys.stderr)
        code = 128 + signum
    sys.exit(code)
