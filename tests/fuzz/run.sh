#!/usr/bin/env bash
# Property-based fuzzing of a live server from its OpenAPI document: every check, a bounded time.
# Usage: tests/fuzz/run.sh [SECONDS] (default 120). Fails on any failure or error schemathesis reports.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
SECONDS_BUDGET=${1:-120}
home=$(mktemp -d)
port=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
token="fuzz-$(date +%s%N)"
HMI_ADMIN_TOKEN=$token HF_HUB_OFFLINE=1 $PY -m tests.fuzz.serve "$home" "$port" >"$home/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$home"' EXIT
for _ in $(seq 300); do grep -q READY "$home/server.log" && break; kill -0 $server || { cat "$home/server.log"; exit 1; }; sleep 1; done
# One worker: hypothesis parses lambda sources with ast, which CPython 3.11 does not allow from two threads at once.
$PY -m schemathesis.cli --config-file tests/fuzz/schemathesis.toml run "http://127.0.0.1:$port/openapi.json" \
    --checks all -H "Authorization: Bearer $token" --max-time "$SECONDS_BUDGET" --workers 1 --seed 20261123 \
    --report ndjson --report-dir "$home/report" | tee "$home/st.log" | tail -40
status=${PIPESTATUS[0]}
# The failures and errors themselves, which the tail above may not reach.
if [ "$status" != 0 ]; then grep -B2 -A40 -m3 "FAILURES\|ERRORS\|Errors:" "$home/st.log" | head -150; fi
if grep -q "unhandled error" "$home/server.log"; then echo "the server logged an unhandled error:"; grep -A20 "unhandled error" "$home/server.log" | head -60; exit 1; fi
exit "$status"
