#!/usr/bin/env bash
# The workflow ladder on one GPU: gpt_small in bf16 on CUDA, baseline -> compile -> profile (CUDA timeline,
# memory snapshot) -> scale (only with 2+ GPUs) -> checkpoint (async, CUDA staging) -> resume in a fresh process
# -> fp8 (float8 linear layers, compiled, gated against the compile rung in bf16; GPUs of compute capability 8.9+
# with torchao); then benchmarks/gpu_checks.py: the items of docs/gpu.md only a GPU confirms (pinning, TF32, CUDA
# graphs with evaluation, async save + resume, memory snapshot time, the activation checkpointing modes, fp8 against
# bf16 with and without checkpointing), side by side.
# Budget: about 5 minutes on one H100/H200 for the ladder (cold inductor cache included; the fp8 rung 1 more) + at
# most 3 for the checks; the activation checkpointing and fp8 checks (9 compiled runs) take ~6 more:
# CHECKS_BUDGET_S=600 CHECKS_ONLY=activation_checkpointing,fp8 bash benchmarks/gpu_ladder.sh
#
#   bash benchmarks/gpu_ladder.sh            # on the GPU machine
#   bash benchmarks/gpu_ladder.sh --smoke    # anywhere, CPU included: tiny model, few steps (the tests run this)
#
# The report (report.md, report.json, report.png) and the console log land in the sweep folder, and are copied
# to $OUT when it is set. Environment: PYTHON (default python3), WHEELS (a folder of wheels to install the
# missing Python packages from, offline: hydra-core, omegaconf, antlr4-python3-runtime), CHECKS_BUDGET_S (180)
# and CHECKS_ONLY (comma-separated checks of gpu_checks.py; all by default). Extra arguments are
# passed to train.py as overrides. Exit code: the sweep's (non-zero when a rung failed or a gate FAILED).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then
  SMOKE=1
  shift
fi
die() { echo "gpu_ladder.sh: $*" >&2; exit 2; }

# trainflow from this checkout, whether or not it is pip-installed here
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if ! "$PYTHON" -c "import hydra, omegaconf" 2>/dev/null; then
  [[ -n "${WHEELS:-}" ]] || die "hydra-core is not installed for $PYTHON; install it (pip install hydra-core==1.3.8) \
or set WHEELS to a folder of its wheels (hydra-core, omegaconf, antlr4-python3-runtime)"
  site="$(mktemp -d)/site"
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$site" "$WHEELS"/*.whl
  export PYTHONPATH="$PYTHONPATH:$site"
fi
missing="$("$PYTHON" -c "
import importlib.util as u
print(' '.join(m for m in ('torch', 'hydra', 'omegaconf', 'cloudpickle', 'matplotlib', 'tqdm', 'numpy')
               if u.find_spec(m) is None))")"
[[ -z "$missing" ]] || die "missing Python packages for $PYTHON: $missing; install them (or set WHEELS)"
GPUS="$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")"

if [[ $SMOKE == 1 ]]; then
  # Same rungs, a 2-layer model and 12 steps: checks this script and the ladder, not speed. The aot_eager
  # backend traces and checks like inductor but skips its code generation (a minute of CPU on a cold cache).
  RUNGS="baseline,compile,profile,ddp,fsdp,checkpoint,resume"
  ARGS=(model=gpt_tiny model.n_layer=2 model.n_embd=64 model.n_head=2 model.block_size=32
        trainer.batch_size=8 trainer.max_steps=12 trainer.excluded_steps=2 trainer.eval_steps=2
        compile.backend=aot_eager profiler.wait=1 profiler.warmup=1 profiler.active=2 logger=none)
  # the scale rungs run one rank per visible GPU (parallelism.nproc_per_node=auto): two of them
  if [[ $GPUS -ge 2 ]]; then export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0,1}"; fi
  if [[ $GPUS -eq 1 ]]; then RUNGS="baseline,compile,profile,checkpoint,resume"; fi
else
  [[ $GPUS -ge 1 ]] || die "no CUDA GPU visible to $PYTHON; run with --smoke for the CPU check"
  if [[ $GPUS -ge 2 ]]; then
    RUNGS="baseline,compile,profile,ddp,fsdp,checkpoint,resume"
  else
    RUNGS="baseline,compile,profile,checkpoint,resume"
    echo "gpu_ladder.sh: one GPU: the scale rungs (ddp, fsdp) need two and are left out (their gates say so)"
  fi
  # the fp8 rung: float8 tensor cores (compute capability 8.9+) and torchao (pip install 'trainflow[fp8]')
  if "$PYTHON" -c "import sys, torch, importlib.util as u; \
      sys.exit(0 if torch.cuda.get_device_capability() >= (8, 9) and u.find_spec('torchao') else 1)"; then
    RUNGS="$RUNGS,fp8"
  else
    echo "gpu_ladder.sh: no fp8 rung: it needs a GPU of compute capability 8.9+ and torchao" \
      "(pip install 'trainflow[fp8]')"
  fi
  # CUDA's atomics-based backward kernels are not bit-reproducible, so two uninterrupted runs differ too: the
  # resumed losses get a tolerance here (the first GPU ladder: 2.3e-4 at most over 100 steps).
  ARGS=(model=gpt_small trainer.precision=bf16 trainer.device=cuda trainer.batch_size=16 trainer.max_steps=200
        trainer.excluded_steps=10 trainer.eval_steps=10 ladder.resume_atol=0.02
        profiler.memory_snapshot=true profiler.record_shapes=true profiler.profile_memory=true
        checkpoint.mode=async logger=none)
fi

SWEEP="${SWEEP_DIR:-$ROOT/multirun/gpu_ladder/$(date +%Y-%m-%d_%H-%M-%S)}"
mkdir -p "$SWEEP"
LOG="$SWEEP.console.log"  # beside the sweep folder while the ladder runs (trainflow writes only into its own folders)
echo "gpu_ladder.sh: $GPUS GPU(s); rungs $RUNGS; sweep folder $SWEEP"
cd "$ROOT"
start=$SECONDS
set +e
"$PYTHON" train.py -m experiment=ladder "ladder=$RUNGS" "${ARGS[@]}" "$@" "hydra.sweep.dir=$SWEEP" 2>&1 \
  | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
echo "gpu_ladder.sh: the ladder took $((SECONDS - start)) s; exit code $rc; report: $SWEEP/report.md"
checks_rc=0
if [[ $SMOKE == 0 ]]; then
  # What only a GPU confirms (docs/gpu.md): pinning, TF32, CUDA graphs with eval, async save + resume, snapshot,
  # the energy counter.
  set +e
  "$PYTHON" benchmarks/gpu_checks.py --out "$SWEEP" --budget-s "${CHECKS_BUDGET_S:-180}" \
    ${CHECKS_ONLY:+--only "$CHECKS_ONLY"} 2>&1 \
    | tee -a "$LOG"
  checks_rc=${PIPESTATUS[0]}
  set -e
  echo "gpu_ladder.sh: checks exit code $checks_rc; report: $SWEEP/gpu_checks.md"
fi
mv "$LOG" "$SWEEP/console.log"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  for f in report.md report.json report.png console.log gpu_checks.md gpu_checks.json; do
    if [[ -f "$SWEEP/$f" ]]; then cp "$SWEEP/$f" "$OUT/"; fi
  done
fi
if [[ $rc == 0 ]]; then rc=$checks_rc; fi
exit "$rc"
