"""The decisions trainflow makes for CUDA runs, tested on CPU: device mapping, CUDA graphs, FSDP2 dtypes and
resharding, TF32 and the peaks MFU divides by, tolerances by arithmetic, pinned batches.

What only a GPU can show (speed, the memory snapshot's dump time) is in docs/gpu.md and benchmarks/gpu_ladder.sh.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainflow.compile.compiler import effective_mode
from trainflow.config.checks import check_compile, check_parallelism
from trainflow.config.schema import DataSection, FSDPConfig, RunConfig, typed_run
from trainflow.data import Pinned, StreamSampler, SyntheticTokens, TokenWindows, VariableLengths, make_loader
from trainflow.distributed import DistEnv
from trainflow.distributed.parallelism import fsdp_dtypes
from trainflow.distributed.process_group import cuda_index, node_count
from trainflow.errors import ConfigError
from trainflow.guards.parity import ParityCheck
from trainflow.metrics.flops import gpu_peak_flops
from trainflow.metrics.verdict import verdict
from trainflow.util.device import configure_matmul, matmul_math
from trainflow.util.float8 import fp8_refusal
from trainflow.util.tolerance import TOLERANCE


def cfg(**overrides) -> RunConfig:
    """A typed run config of a GPT, the schema's defaults and `overrides` (section -> its keys)."""
    return typed_run({"model": {"_target_": "trainflow.models.gpt.GPT"}, "data": {"seq_len": 32}, "task": {},
                      "optim": {}, "logger": {}, **overrides})


# -- which GPU a rank uses ----------------------------------------------------------------------------------------


def test_every_task_seeing_all_gpus_uses_its_local_rank() -> None:
    assert [cuda_index(r, 8, 8, bound_per_task=False) for r in range(8)] == list(range(8))
    assert cuda_index(3, 4, 8, bound_per_task=True) == 3  # 8 visible, 4 ranks: LOCAL_RANK still fits


def test_one_gpu_bound_per_task_is_that_tasks_device_zero() -> None:
    """SLURM --gpus-per-task=1 / --gpu-bind: each task sees one GPU, whatever its local rank."""
    assert [cuda_index(r, 8, 1, bound_per_task=True) for r in range(8)] == [0] * 8


def test_more_ranks_than_gpus_without_binding_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"parallelism.nproc_per_node: 4 processes need 4 GPUs, but 2 are visible"):
        cuda_index(3, 4, 2, bound_per_task=False)


def test_nodes_are_ranks_over_ranks_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)  # SLURM sets no GROUP_WORLD_SIZE
    assert node_count(32) == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert node_count(4) == 1


# -- CUDA graphs ------------------------------------------------------------------------------------------------


def test_max_autotune_drops_cuda_graphs_on_several_ranks_only() -> None:
    assert effective_mode("max-autotune", 1) == "max-autotune"
    assert effective_mode("max-autotune", 2) == "max-autotune-no-cudagraphs"
    assert effective_mode("default", 8) == "default" and effective_mode(None, 8) is None


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_reduce_overhead_under_ddp_or_fsdp_is_refused_in_one_line(strategy: str) -> None:
    config = cfg(compile={"enabled": True, "mode": "reduce-overhead"}, parallelism={"strategy": strategy})
    with pytest.raises(ConfigError) as err:
        check_compile(config)
    assert str(err.value) == (
        f"compile.mode: reduce-overhead captures CUDA graphs, which break under parallelism={strategy} (open "
        "PyTorch issues: cudagraph trees with DDP's hooks and FSDP's all-gathers); use "
        "compile.mode=max-autotune-no-cudagraphs or compile=default")


def test_the_verdict_recommends_cuda_graphs_only_to_one_process() -> None:
    overhead_bound = {"steps": 3, "step_s": 0.3, "step_ms": [100.0] * 3,
                      "seconds": {"overhead": 0.25, "forward_backward_compute": 0.05}, "covered": {}}
    single = verdict(overhead_bound, "cuda")
    several = verdict(overhead_bound, "cuda", distributed=True)
    assert single["bound"] == several["bound"] == "cpu-overhead-bound"
    assert "compile.mode=reduce-overhead" in single["action"]
    assert "reduce-overhead" not in several["action"] and "max-autotune-no-cudagraphs" in several["action"]


@pytest.mark.parametrize("applied", [frozenset(), frozenset({"bf16"}), frozenset({"bf16", "compile"})])
def test_the_verdict_advises_only_what_the_run_does_not_do_yet(applied: frozenset[str]) -> None:
    # the first GPU ladder (bf16, compiled, compute-bound) was told to use bf16 and compile
    totals = {"steps": 3, "step_s": 0.3, "step_ms": [100.0] * 3, "covered": {},
              "seconds": {"forward_backward_compute": 0.25, "overhead": 0.05}}
    v = verdict(totals, "cuda", applied=applied)
    assert v is not None and v["bound"] == "compute-bound", v
    assert ("trainer.precision=bf16" in v["action"]) == ("bf16" not in applied), v["action"]
    assert ("compile.enabled=true" in v["action"]) == ("compile" not in applied), v["action"]
    assert "parallelism=ddp or fsdp" in v["action"]
    overhead_bound = {**totals, "seconds": {"forward_backward_compute": 0.05, "overhead": 0.25}}
    for distributed in (False, True):
        v = verdict(overhead_bound, "cuda", distributed=distributed, applied=applied)
        assert v is not None and v["bound"] == "cpu-overhead-bound", v
        assert ("compile.enabled=true" in v["action"]) == ("compile" not in applied), v["action"]
        assert "trainer.batch_size" in v["action"]
        assert ("compile.mode=reduce-overhead" in v["action"]) == (not distributed), v["action"]


# -- FSDP2 --------------------------------------------------------------------------------------------------------


def test_fsdp_dtypes_follow_torchtitan_under_bf16() -> None:
    assert fsdp_dtypes(None, None, "bf16") == ("bf16", "fp32")  # bf16 all-gathers, fp32 reduce-scatter
    assert fsdp_dtypes(None, None, "fp32") == (None, None)
    assert fsdp_dtypes("fp32", None, "bf16") == ("fp32", None)
    assert fsdp_dtypes("bf16", "bf16", "fp32") == ("bf16", "bf16")  # what the user set wins


@pytest.mark.parametrize("key", ["param_dtype", "reduce_dtype"])
def test_fp16_without_a_loss_scaler_is_refused(key: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_parallelism(cfg(parallelism={"strategy": "fsdp", "fsdp": {key: "fp16"}}))
    assert str(err.value).startswith(f"parallelism.fsdp.{key}: fp16 gradients overflow without a loss scaler")


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 2)  # the root's own parameters: its FSDP unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[1](self.blocks[0](x)))


def test_fsdp_reshards_blocks_but_leaves_the_root_gathered_and_uses_bf16_params_fp32_reduce() -> None:
    """On a real one-rank gloo group: FSDP2's own state says what each unit does after forward."""
    import torch.distributed as dist

    from trainflow.distributed.parallelism import shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = shard(TwoBlocks(), FSDPConfig(), DistEnv(0, 1, 0, torch.device("cpu")), "bf16")
        model(torch.randn(2, 8)).sum().backward()  # FSDP settles the root's resharding at its first forward
        groups = {name: m._get_fsdp_state()._fsdp_param_group for name, m in
                  [("root", model), ("block", model.blocks[0])]}
        # post_forward_mesh_info None: parameters stay gathered after forward (no all-gather at backward's start)
        assert groups["root"].post_forward_mesh_info is None
        assert groups["block"].post_forward_mesh_info is not None
        policy = groups["block"].mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    finally:
        dist.destroy_process_group()


# -- arithmetic: TF32, peaks, tolerances ----------------------------------------------------------------------


@pytest.fixture
def restore_tf32():
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


def test_fp32_runs_on_cuda_use_tf32_unless_turned_off(restore_tf32) -> None:
    cuda = torch.device("cuda", 0)  # only flags are set: no GPU is touched
    configure_matmul(cuda, "fp32", tf32=True)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32" and matmul_math(cuda, "fp32") == "tf32"
    configure_matmul(cuda, "fp32", tf32=False)
    assert torch.backends.cuda.matmul.fp32_precision == "ieee" and matmul_math(cuda, "fp32") == "fp32"
    assert matmul_math(cuda, "bf16") == "bf16" and matmul_math(torch.device("cpu"), "fp32") == "fp32"


@pytest.mark.parametrize(("name", "math", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9), ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.4), ("NVIDIA H200 NVL", "tf32", 417.5), ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
    ("NVIDIA A100 80GB PCIe", "bf16", 312.0), ("NVIDIA L40", "bf16", 181.0), ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40S", "bf16", 362.1), ("Tesla T4", "fp32", 8.1), ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
])
def test_peaks_match_whole_device_names_per_arithmetic(name: str, math: str, tflops: float) -> None:
    assert gpu_peak_flops(name, math) == pytest.approx(tflops * 1e12)


def test_unknown_devices_and_missing_units_have_no_peak() -> None:
    assert gpu_peak_flops("NVIDIA H100X Prototype", "bf16") is None
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 units
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", "fp32") == pytest.approx(15.7e12)


def parity_check(config: RunConfig, env: DistEnv) -> ParityCheck:
    """The check as a rank other than 0 builds it: nothing but its settings (no reference model, no batches)."""
    return ParityCheck(config.parallelism, config.trainer, config.optim, config.data, env, nn.Linear(2, 2), None,
                       None)


def test_tolerances_follow_the_arithmetic() -> None:
    compile_check = TOLERANCE["compile.check"]
    assert compile_check["fp32"] < compile_check["tf32"] and compile_check["fp32"] < compile_check["bf16"]
    parity = TOLERANCE["parallelism.check"]
    for precision, expected in (("fp32", parity["fp32"]), ("bf16", parity["bf16"])):
        config = cfg(trainer={"precision": precision}, parallelism={"strategy": "ddp", "check": True})
        check = parity_check(config, DistEnv(1, 2, 1, torch.device("cpu"), "ddp"))
        assert check.tolerance == expected  # rank 1 keeps no reference: nothing else is built
    config = cfg(parallelism={"strategy": "ddp", "check": True, "check_tolerance": 0.5})
    assert parity_check(config, DistEnv(1, 2, 1, torch.device("cpu"), "ddp")).tolerance == 0.5
    assert parity["bf16"] >= 5 * 4e-3  # bf16 gradients of 2-sample shards differ by ~4e-3


# -- float8: which GPUs train in fp8 --------------------------------------------------------------------------------


@pytest.mark.parametrize(("capability", "name", "refused"), [
    ((7, 0), "Tesla V100-SXM2-16GB", True), ((8, 0), "NVIDIA A100-SXM4-80GB", True),
    ((8, 6), "NVIDIA GeForce RTX 3090", True), ((8, 9), "NVIDIA L40S", False), ((9, 0), "NVIDIA H100 80GB HBM3", False),
    ((10, 0), "NVIDIA B200", False), ((12, 0), "NVIDIA GeForce RTX 5090", False)])
def test_fp8_needs_compute_capability_8_9_or_newer(capability: tuple[int, int], name: str, refused: bool) -> None:
    """The GPUs before Ada (8.9) have no float8 tensor cores: refused in one line naming the GPU and its capability;
    Ada, Hopper and Blackwell pass on to the torchao check."""
    refusal = fp8_refusal("cuda", capability, name, torchao_installed=True)
    if refused:
        assert refusal == (f"trainer.precision: fp8 needs float8 tensor cores (compute capability 8.9 or newer: "
                           f"Ada, Hopper), and {name} is {capability[0]}.{capability[1]}; use "
                           "trainer.precision=bf16")
    else:
        assert refusal is None
        assert "torchao is not installed: pip install 'trainflow[fp8]'" in fp8_refusal("cuda", capability, name, False)


def test_fp8_off_a_gpu_is_refused_whatever_is_installed() -> None:
    for torchao_installed in (True, False):
        assert fp8_refusal("cpu", None, None, torchao_installed).endswith("and this run is on cpu; use "
                                                                          "trainer.precision=bf16 or fp32")


# -- batches ready for asynchronous copies ----------------------------------------------------------------------


def test_batches_are_contiguous_and_pinning_comes_after_cutting() -> None:
    import numpy as np

    windows = TokenWindows(np.arange(1000, dtype=np.uint16), seq_len=16)
    synthetic = SyntheticTokens(64, 256, 16, seed=0)
    for dataset in (windows, synthetic):
        assert all(t.is_contiguous() for t in dataset[torch.arange(4)])
    loader_cfg = DataSection(num_workers=0, seq_lens=[8, 16], persistent_workers=False, prefetch_factor=None)
    loader = make_loader(synthetic, StreamSampler(64, 4, 0, 1, seed=0), loader_cfg, pin_memory=True)
    assert isinstance(loader, Pinned) and isinstance(loader.loader, VariableLengths)
    unpinned = make_loader(synthetic, StreamSampler(64, 4, 0, 1, seed=0), loader_cfg, pin_memory=False)
    assert isinstance(unpinned, VariableLengths)


def test_peak_memory_on_cpu_is_the_process_peak_and_has_no_reserved_figure() -> None:
    import resource

    from trainflow.loop.meter import PeakMemory

    memory = PeakMemory(torch.device("cpu"))
    memory.reset()  # the resident-set peak cannot be reset: it stays the process's
    assert memory.take() == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary = memory.summary()
    assert summary["peak_memory_bytes"] >= 50e6 and summary["peak_memory_reserved_bytes"] is None


# -- checkpoint and run-directory locks on filesystems without flock ----------------------------------------------


def test_only_a_missing_flock_falls_back_to_a_lock_file() -> None:
    import errno

    from trainflow.util.locks import flock_unsupported

    assert flock_unsupported(OSError(errno.ENOLCK, "no locks")) and flock_unsupported(OSError(errno.EOPNOTSUPP, ""))
    assert not flock_unsupported(OSError(errno.EACCES, "denied")) and not flock_unsupported(OSError(errno.EROFS, ""))


def test_the_lock_file_refuses_a_second_run_and_is_removed_at_the_end(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from trainflow.util.locks import OWNER_FILE, DirLock

    lock = DirLock(tmp_path, use_flock=False)
    owner = tmp_path / OWNER_FILE
    assert owner.read_text().startswith(f"pid {os.getpid()} on ")
    other = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from trainflow.util.locks "
                            "import DirLock; DirLock(Path(sys.argv[1]), use_flock=False)", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode != 0
    assert f"checkpoint.dir: {tmp_path} is in use by another run (pid {os.getpid()} on " in other.stderr
    lock.release()
    assert not owner.exists()


def test_a_dead_holder_on_this_host_is_stale_and_one_on_another_host_is_named(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from trainflow.util.locks import OWNER_FILE, DirLock

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = tmp_path / OWNER_FILE
    owner.write_text(f"pid {finished.stdout.strip()} on {socket.gethostname()}, since earlier\n")
    lock = DirLock(tmp_path, use_flock=False)  # the crashed holder's file is taken over
    assert f"pid {finished.stdout.strip()} " not in owner.read_text()
    lock.release()
    owner.write_text("pid 4242 on another-node, since earlier\n")
    with pytest.raises(ConfigError) as err:
        DirLock(tmp_path, use_flock=False)
    assert "(pid 4242 on another-node, since earlier; this filesystem has no flock" in str(err.value)
    assert str(err.value).endswith(f"if that run is gone (its host crashed), delete {owner}")


def test_a_checkout_that_is_not_installed_still_imports(tmp_path: Path) -> None:
    """gpu_ladder.sh runs trainflow from a checkout on PYTHONPATH on a bare GPU host (no package metadata): the
    first GPU run stopped at `import trainflow` with PackageNotFoundError."""
    import shutil
    import subprocess
    import sys

    checkout = tmp_path / "src"  # the package alone: no trainflow.egg-info beside it, no site-packages (-S)
    shutil.copytree(Path(__file__).resolve().parents[1] / "src" / "trainflow", checkout / "trainflow")
    proc = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(checkout)!r}); "
                           "import trainflow; print(trainflow.__version__)"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "0.1.0+checkout", proc.stderr
