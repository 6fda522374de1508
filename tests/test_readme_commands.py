"""Every training command README and the docs/ pages show is one trainflow accepts.

The commands are taken from the pages' code blocks and inline code (`trainflow train ...`, `python -m trainflow
train ...`, a checkout's `python train.py ...` and `torchrun ... train.py ...`), split as a shell splits them,
parsed by Hydra's override parser, expanded into the jobs of a sweep, composed against conf/ and checked by
trainflow.config.checks.check_config: the checks a run does before any work.
Training each would need GPUs, a SLURM cluster or a user's corpus; the commands that train here on CPU are run
for real by the other tests. A command that fails names itself and the reason.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers.runs import ROOT
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from trainflow.conf import CONFIG_DIR
from trainflow.config.checks import check_config

COMMAND = re.compile(r"^(?:python\s+(?:\S*/)?train\.py|torchrun\s.*?(?:\S*/)?train\.py"
                     r"|(?:python\s+-m\s+)?trainflow\s+train)(?=\s|$)")


def commands_in(text: str) -> list[str]:
    """`train.py` commands of a page in order, each on one line (inline code may wrap; blocks use `\\`)."""
    found, fenced = [], False
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif (fenced or line.startswith(("    ", "\t"))) and COMMAND.match(line.strip()):
            found.append(" ".join(re.split(r"\s#\s", line.strip())[0].split()))  # without a trailing comment
    for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", text):
        span = " ".join(span.split())
        if COMMAND.match(span):
            found.append(span)
    return list(dict.fromkeys(found))


def overrides_of(command: str) -> tuple[list[str], bool]:
    """(the Hydra overrides, whether it is a -m sweep) of a command line; Hydra's own flags are set aside."""
    words = shlex.split(command)
    words = words[next(i for i, w in enumerate(words) if w.endswith("train.py") or w == "train") + 1:]
    multirun = False
    overrides, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("-m", "--multirun"):
            multirun = True
        elif word in ("--cfg", "-c", "--package", "-p"):
            skip = True  # takes a value (job, hydra, all / a package name)
        elif word.startswith("-"):
            continue  # --help, --info, ...
        else:
            overrides.append(word)
    return overrides, multirun


def jobs_of(overrides: list[str]) -> list[list[str]]:
    """The jobs a sweep would run: one override list per combination of the swept values."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def page_commands() -> list[tuple[str, str]]:
    """(page, command) for README.md and then docs/*.md; a command shown on several pages is checked once."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    first_page: dict[str, str] = {}
    for page in pages:
        for command in commands_in(page.read_text()):
            first_page.setdefault(command, "README" if page.name == "README.md" else f"docs/{page.name}")
    return [(page, command) for command, page in first_page.items()]


PAGE_COMMANDS = page_commands()
COMMANDS = [command for _, command in PAGE_COMMANDS]
README_WIDTH_AT_MOST = 120  # characters a line: the page reads in a terminal or an editor without wrapping


def test_the_pages_show_commands_of_every_stage() -> None:
    assert len(COMMANDS) >= 20, COMMANDS
    for fragment in ("experiment=seed_mlp", "profiler=schedule", "parallelism=fsdp", "checkpoint=dcp",
                     "experiment=ladder", "hydra/launcher=slurm", "data.paths="):
        assert any(fragment in c for c in COMMANDS), fragment


def test_the_extractor_finds_wrapped_and_continued_commands() -> None:
    text = ("Inline `python train.py a=1\nb=2` and `trainflow export x`.\n\n"
            "    python train.py -m c=3 \\\n        d=4   # a comment\n    torchrun --nproc_per_node=2 train.py e=5\n"
            "    trainflow train f=6\n    python -m trainflow train g=7\n")
    assert commands_in(text) == ["python train.py -m c=3 d=4", "torchrun --nproc_per_node=2 train.py e=5",
                                     "trainflow train f=6", "python -m trainflow train g=7", "python train.py a=1 b=2"]
    assert overrides_of("trainflow train -m f=6,7") == (["f=6,7"], True)
    assert overrides_of("python train.py -m --cfg job 'x=[\"~/a\"]' y=1,2") == (['x=["~/a"]', "y=1,2"], True)
    assert jobs_of(["y=1,2", "z=3"]) == [["y=1", "z=3"], ["y=2", "z=3"]]


def test_readme_shows_one_command_per_stage_and_stays_narrow() -> None:
    readme = [command for page, command in PAGE_COMMANDS if page == "README"]
    assert "trainflow train" in readme  # compile: the default
    for fragment in ("compile=off", "profiler=schedule", "parallelism=", "checkpoint=dcp", "experiment=ladder"):
        assert any(fragment in c for c in readme), fragment
    wide = [n for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
            if len(line) > README_WIDTH_AT_MOST]
    assert wide == [], f"README.md lines {wide} are over {README_WIDTH_AT_MOST} characters; wrap them"


@pytest.mark.parametrize(("page", "command"), PAGE_COMMANDS)
def test_page_command_parses_and_composes(page: str, command: str) -> None:
    overrides, multirun = overrides_of(command)
    try:
        jobs = jobs_of(overrides) if multirun else [overrides]
        OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        pytest.fail(f"{page} command `{command}`: Hydra cannot parse it: {str(exc).splitlines()[0]}")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for job in jobs:
            try:
                cfg = compose("train", overrides=job)
                if importable_targets(job):  # validation checks the keys against the code it names
                    check_config(cfg)
            except Exception as exc:  # noqa: BLE001 (any failure is reported with the command that caused it)
                pytest.fail(f"{page} command `{command}` (job {job}): {type(exc).__name__}: {exc}")


def importable_targets(job: list[str]) -> bool:
    """Whether every `_target_` the command names imports here (README's own-code example names a user's package
    and torchvision: tests/test_own_code.py trains it with stand-ins)."""
    from trainflow.errors import ConfigError
    from trainflow.util.targets import import_target

    try:
        for key, value in (o.split("=", 1) for o in job if o.split("=")[0].endswith("._target_")):
            import_target(key, value, "code")
    except ConfigError:
        return False
    return True


def test_a_broken_command_is_named() -> None:
    """What the tests above report for README's old `data.paths=[~/corpus]`, which Hydra's grammar rejects."""
    with pytest.raises(pytest.fail.Exception, match=r"README command `python train.py data.paths=\[~/corpus\]`: "
                                                    r"Hydra cannot parse it"):
        test_page_command_parses_and_composes("README", "python train.py data.paths=[~/corpus]")


def test_the_corpus_example_reaches_trainflow_as_a_path_it_expands() -> None:
    """README quotes it as shells and Hydra need: trainflow gets the string `~/corpus`, which data.paths expands."""
    command = next(c for c in COMMANDS if "~/corpus" in c)
    overrides, _ = overrides_of(command)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[o for o in overrides if not o.startswith(("experiment=", "trainer."))])
    assert list(cfg.data.paths) == ["~/corpus"]
    assert Path(cfg.data.paths[0]).expanduser() == Path.home() / "corpus"
