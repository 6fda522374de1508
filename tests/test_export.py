"""Exports of checkpoints saved by one process, DDP 2 and FSDP 2 (with compile and activation checkpointing on),
loaded by their real consumers: safetensors, transformers (GPT2LMHeadModel), torch's DCP tools without trainflow.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import tree_hash
from helpers.processes import run_process, start_process
from helpers.runs import ROOT, TINY_GPT, train, wait_for

from trainflow.checkpoint import export_weights
from trainflow.checkpoint.export import STAGING, Source
from trainflow.errors import CheckpointError, ConfigError
from trainflow.models.gpt import GPT

STEPS = ["trainer.max_steps=3", "trainer.eval_every=0", "trainer.eval_steps=2", "checkpoint=dcp",
         "checkpoint.every_steps=3", "compile=default", "compile.backend=eager",
         "parallelism.activation_checkpointing=full"]
STRATEGIES = {"single": [], "ddp2": ["parallelism=ddp", "parallelism.nproc_per_node=2"],
              "fsdp2": ["parallelism=fsdp", "parallelism.nproc_per_node=2", "compile.scope=blocks"]}
WRAPPERS = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per strategy, a run of 3 steps with one committed checkpoint, and its exports in every format beside it."""
    out = {}
    for name, strategy in STRATEGIES.items():
        run = train(tmp_path_factory.mktemp(name) / "run", *TINY_GPT, *STEPS, *strategy)
        assert run.returncode == 0, run.stderr[-3000:]
        for fmt in ("torch", "safetensors", "hf", "dcp"):
            export_weights(run.run_dir, run.run_dir.parent / fmt, fmt)
        export_weights(run.run_dir, run.run_dir.parent / "dcp_optim", "dcp", with_optimizer=True)
        out[name] = run.run_dir
    return out


@pytest.fixture(params=list(STRATEGIES))
def run_dir(request: pytest.FixtureRequest, runs: dict[str, Path]) -> Path:
    return runs[request.param]


def trainflow_logits(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """trainflow's GPT of the run's config, with the weights of the torch export."""
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    model = GPT(**{k: v for k, v in cfg.items() if k != "_target_"})
    model.load_state_dict(torch.load(run_dir.parent / "torch", weights_only=True))
    return model.eval()(tokens)


TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def test_keys_are_the_models_own_names(run_dir: Path) -> None:
    from safetensors.torch import load_file

    from trainflow.checkpoint.safe_io import read_metadata

    (step,) = (run_dir / "checkpoints").glob("step_*")
    saved = list(read_metadata(step).state_dict_metadata)
    exported = load_file(run_dir.parent / "safetensors" / "model.safetensors")
    assert len(saved) > 29 and len(exported) == 29  # the model's tensors and the optimizer's
    for key in [*saved, *exported]:
        assert not any(w in key for w in WRAPPERS), key
    assert set(exported) == set(GPT(n_layer=2, n_embd=64, n_head=2, block_size=32).state_dict())


def test_safetensors_holds_the_checkpoints_weights(run_dir: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(run_dir.parent / "safetensors" / "model.safetensors")
    reference = torch.load(run_dir.parent / "torch", weights_only=True)
    assert weights.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(weights[key], tensor), key
    info = json.loads((run_dir.parent / "safetensors" / "trainflow_export.json").read_text())
    assert info["step"] == 3 and info["config"]["model"]["n_layer"] == 2
    assert info["world_size"] == (1 if run_dir.parent.name.startswith("single") else 2)


def test_hf_folder_loads_in_transformers_with_the_same_logits(run_dir: Path) -> None:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(run_dir.parent / "hf").eval()
    assert model.config.n_layer == 2 and model.config.activation_function == "gelu"
    with torch.no_grad():
        theirs = model(input_ids=TOKENS).logits
        ours = trainflow_logits(run_dir, TOKENS)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    assert ours.abs().max() > 0.1  # trained weights, not zeros


def test_the_hf_folder_holds_the_byte_tokenizer_and_generates_through_the_auto_classes(runs: dict[str, Path]
                                                                                        ) -> None:
    """tokenizer=bytes (the default run's): the folder's tokenizer gives each byte its id, as trainflow encoded the
    text it trained on, and AutoModelForCausalLM + AutoTokenizer generate from a prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = runs["single"].parent / "hf"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = "def f(a):\n é"  # with the new tokens, within the model's 32 positions
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == list(prompt.encode()) and len(tokenizer) == 256
    assert tokenizer.decode(ids[0]) == prompt
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 8) and torch.equal(out[0, :ids.shape[1]], ids[0])
    with torch.no_grad():  # greedy: each new token is the argmax of trainflow's own GPT on the text so far
        expected = trainflow_logits(runs["single"], out[:, :-1])[0, ids.shape[1] - 1:].argmax(-1)
    assert torch.equal(out[0, ids.shape[1]:], expected)


def test_a_gpt_checkpoint_of_the_old_qkv_layout_is_not_exported_as_gpt2(runs: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint saved before the GPT's weights_layout (qkv rows q, k, v of all heads) would map to wrong GPT-2
    weights: refused in one line, nothing written."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["single"], run_dir)
    (step,) = sorted((run_dir / "checkpoints").glob("step_*"))
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["weights_layout"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as refused:
        export_weights(step, tmp_path / "hf", "hf")
    assert str(refused.value) == (f"export --format hf: {step} holds the GPT's weights in layout 1, and this "
                                  "trainflow maps layout 2 to GPT-2; export it with the trainflow that saved it")
    assert not (tmp_path / "hf").exists()


def test_dcp_folder_reads_with_torch_alone(runs: dict[str, Path]) -> None:
    """One process that never imports trainflow reads every run's stock DCP exports with torch's own tools."""
    script = textwrap.dedent("""
        import sys, torch, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        for folder in sys.argv[1:]:
            dcp_to_torch_save(folder + "/dcp_optim", folder + "/whole.pt")
            whole = torch.load(folder + "/whole.pt", weights_only=False)
            model = {k: torch.empty_like(v) for k, v in whole["model"].items()}
            dcp.load({"model": model}, checkpoint_id=folder + "/dcp", no_dist=True)
            torch.save({"model": model, "optimizer": whole["optimizer"]}, folder + "/read.pt")
        assert "trainflow" not in sys.modules
    """)
    folders = [str(r.parent) for r in runs.values()]
    proc = subprocess.run([sys.executable, "-c", script, *folders], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for run_dir in runs.values():
        read = torch.load(run_dir.parent / "read.pt", weights_only=False)
        reference = torch.load(run_dir.parent / "torch", weights_only=True)
        assert read["model"].keys() == reference.keys()
        for key, tensor in reference.items():
            assert torch.equal(read["model"][key], tensor), key
        state = read["optimizer"]["state"]
        assert state.keys() == reference.keys() - {"head.weight"} and float(state["ln_f.weight"]["step"]) == 3.0
        assert state["tok_emb.weight"]["exp_avg"].abs().max() > 0
        assert len(read["optimizer"]["param_groups"]) >= 1


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_exported_weights_load_back_into_trainflows_gpt(run_dir: Path, fmt: str) -> None:
    from trainflow.checkpoint.resume import exported_weights, load_exported
    from trainflow.checkpoint.state import TrainState
    from trainflow.distributed import DistEnv

    model = GPT(n_layer=2, n_embd=64, n_head=2, block_size=32)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    load_exported(exported_weights(run_dir.parent / fmt), state, DistEnv(0, 1, 0, torch.device("cpu")))
    reference = torch.load(run_dir.parent / "torch", weights_only=True)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[key]), key
    assert model.head.weight is model.tok_emb.weight  # still tied

    other = GPT(n_layer=2, n_embd=32, n_head=2, block_size=32)
    state.model = other
    with pytest.raises(ConfigError, match=r"tok_emb.weight is \[256, 64\] there, \[256, 32\] in this model"):
        load_exported(exported_weights(run_dir.parent / fmt), state, DistEnv(0, 1, 0, torch.device("cpu")))


def first_loss(run_dir: Path) -> float:
    return next(json.loads(line)["train/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("step") == 1)


def test_a_run_starts_from_a_hugging_face_folder(runs: dict[str, Path], tmp_path: Path) -> None:
    """checkpoint.load=model from the hf export of the FSDP run: the first step trains the exported weights (its
    loss is not the fresh model's, which the single run's first step was: same seed, same batch)."""
    hf = runs["fsdp2"].parent / "hf"
    run = train(tmp_path / "run", *TINY_GPT, "trainer.max_steps=1", "trainer.eval_every=0", "checkpoint=dcp",
                "checkpoint.load=model", f"checkpoint.resume={hf}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"checkpoint.load=model: loaded the weights of {hf}/model.safetensors" in run.stdout
    assert abs(first_loss(run.run_dir) - first_loss(runs["single"])) > 1e-3


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of a GPT with 52 MB of weights (its export takes long enough to be stopped in the middle), 1 step."""
    run = train(tmp_path_factory.mktemp("large") / "run", *TINY_GPT, "model.n_layer=4", "model.n_embd=512",
                "model.n_head=4", "trainer.batch_size=2", "trainer.max_steps=1", "trainer.eval_every=0",
                "trainer.eval_steps=1", "checkpoint=dcp", "checkpoint.verify=false")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.run_dir


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with two committed checkpoints (steps 2 and 4)."""
    run = train(tmp_path_factory.mktemp("small") / "run", *TINY_GPT, "trainer.max_steps=4", "trainer.eval_every=0",
                "trainer.eval_steps=1", "checkpoint=dcp", "checkpoint.every_steps=2", "checkpoint.verify=false")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.run_dir


def start_export(*args: str | Path, output: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return start_process([str(Path(sys.executable).parent / "trainflow"), "export", *map(str, args)], ROOT, env,
                         output)


def signal_once_staged(proc: subprocess.Popen, out: Path, sig: int) -> None:
    """Send `sig` to an export while it writes: stopped (SIGSTOP) the moment its staging folder appears."""
    wait_for(lambda: any(out.parent.glob(f".{out.name}.tmp*")), proc, "the export's staging folder", interval=0.001)
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)


def file_or_tree_hash(path: Path) -> object:
    return tree_hash(path) if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.serial
@pytest.mark.parametrize(("fmt", "sig", "said"), [("torch", signal.SIGINT, "Ctrl-C (SIGINT)"),
                                                  ("safetensors", signal.SIGTERM, "SIGTERM")])
def test_an_interrupted_export_leaves_the_earlier_output_and_nothing_else(large: Path, tmp_path: Path, fmt: str,
                                                                         sig: int, said: str) -> None:
    out = tmp_path / "out"
    export_weights(large, out, fmt)  # the earlier export, which --force would replace
    before = file_or_tree_hash(out)
    proc = start_export(large, out, "--format", fmt, "--force", output=tmp_path / "export.out")
    signal_once_staged(proc, out, sig)
    assert proc.wait(timeout=60) == 128 + sig
    assert (tmp_path / "export.out").read_text().splitlines() == [
        f"Interrupted: trainflow export stopped by {said}; the output is as it was, and nothing of this export is "
        "left"]
    assert file_or_tree_hash(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.out", "out"]


@pytest.mark.serial
def test_the_leftovers_of_killed_exports_are_removed_by_the_next_export(large: Path, small: Path,
                                                                       tmp_path: Path) -> None:
    """SIGKILL leaves an export's staging folder: the next export into that folder removes it, and puts back the
    earlier output of an export killed between its two renames; another program's folder of the same naming and
    the staging folder of a live export stay."""
    out = tmp_path / "model.pt"
    proc = start_export(large, out, output=tmp_path / "killed.out")
    signal_once_staged(proc, out, signal.SIGKILL)
    proc.wait(timeout=60)
    (killed,) = tmp_path.glob(".model.pt.tmp*")
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    export_weights(small, tmp_path / "st", "safetensors")
    earlier = tree_hash(tmp_path / "st")
    stepped = tmp_path / f".st.tmp{gone.pid}"  # killed after the earlier output stepped aside, before the new came
    stepped.mkdir()
    (stepped / STAGING).write_text(f"{host} {gone.pid}\n")
    os.rename(tmp_path / "st", stepped / "old")
    foreign, live = tmp_path / f".notes.tmp{gone.pid}", tmp_path / f".other.tmp{os.getpid()}"
    for folder in (foreign, live):
        folder.mkdir()
        (folder / "data").write_text("someone's\n")
    (live / STAGING).write_text(f"{host} {os.getpid()}\n")  # this test's process: alive
    kept = {p.name: tree_hash(p) for p in (foreign, live)}

    again = run_process([str(Path(sys.executable).parent / "trainflow"), "export", str(small), str(out)], ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not killed.exists() and not stepped.exists()
    assert tree_hash(tmp_path / "st") == earlier
    assert {p.name: tree_hash(p) for p in (foreign, live)} == kept
    with zipfile.ZipFile(out) as archive:  # a torch export says it is one: --force may replace it
        (record,) = [n for n in archive.namelist() if n.endswith("/trainflow_export.json")]
        assert json.loads(archive.read(record))["step"] == 4
    export_weights(small / "checkpoints" / "step_00000002", out, force=True)
    assert torch.equal(torch.load(out, weights_only=True)["tok_emb.weight"],
                       Source(small / "checkpoints" / "step_00000002").read(["app.model.tok_emb.weight"])[
                           "app.model.tok_emb.weight"])


def test_a_checkpoint_retired_while_it_is_read_is_named_not_called_corrupt(small: Path, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The run's retention renames a checkpoint away (then deletes it) while an export reads it: one line saying
    so and naming the newest, not DCP's two logged tracebacks and "corrupt"."""
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(small / "checkpoints", ckpts)
    source = Source(ckpts / "step_00000002")
    os.rename(ckpts / "step_00000002", ckpts / ".tmp-deleting-step_00000002")  # what retention does first
    with pytest.raises(CheckpointError) as removed:
        source.read(list(source.model_keys.values()))
    assert str(removed.value) == (
        f"{ckpts}/step_00000002: removed while the export read it (a run saving into {ckpts} retires all but its "
        "newest checkpoint.keep_last); nothing was written: export again (its newest is now step_00000004)")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("torch")] == []


@pytest.mark.slow
def test_a_hugging_face_model_trained_by_target_exports_by_save_pretrained(tmp_path: Path) -> None:
    """experiment=hf_gpt2: the hf export is the model's own save_pretrained output, and loads back into it."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from trainflow.checkpoint.export import Source
    from trainflow.checkpoint.resume import exported_weights, load_exported
    from trainflow.checkpoint.state import TrainState
    from trainflow.distributed import DistEnv
    from trainflow.models.hf import gpt2

    run = train(tmp_path / "run", "experiment=hf_gpt2", "trainer.max_steps=2", "trainer.eval_every=0",
                "logger=none", "checkpoint=dcp", "checkpoint.every_steps=2", f"tokenizer.cache_dir={tmp_path}/tok",
                f"data.cache_dir={tmp_path}/data")
    assert run.returncode == 0, run.stderr[-3000:]
    export_weights(run.run_dir, tmp_path / "hf", "hf")
    source = Source(run.run_dir)
    saved = source.read(list(source.model_keys.values()))
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").state_dict()
    for key, tensor in saved.items():
        assert torch.equal(loaded[key.removeprefix("app.model.")], tensor), key
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")  # the run's BPE, saved beside the model
    assert len(tokenizer) == 2048 and tokenizer.eos_token_id == 0
    text = "Return the sum of the arguments."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer(text)["input_ids"]) < len(text)  # BPE pieces, not bytes

    model = gpt2(vocab_size=2048, n_positions=128, n_embd=128, n_layer=2, n_head=4)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    load_exported(exported_weights(tmp_path / "hf"), state, DistEnv(0, 1, 0, torch.device("cpu")))
    for key, tensor in saved.items():
        assert torch.equal(model.state_dict()[key.removeprefix("app.model.")], tensor), key
