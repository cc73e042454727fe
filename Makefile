# Everything runs inside .venv, created and filled from requirements.txt on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum < requirements.txt | cut -d' ' -f1)
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TOKENIZERS_PARALLELISM := false

# The dashboard's browser test needs Chromium; on Debian (CI runs as root) it comes from apt.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install browser test demo bench clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

$(CHROMIUM):
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
		|| ($(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

browser: $(CHROMIUM)  ## headless Chromium for tests/e2e/test_dashboard_browser.py

test: $(STAMP) $(CHROMIUM)  ## the whole test suite (offline; the browser test is required here)
	FEDMOE_REQUIRE_BROWSER=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q

demo: $(STAMP)  ## a local federation: coordinator + 3 workers on tiny-qwen2, then a loss table
	HF_HUB_OFFLINE=1 $(PY) scripts/demo.py

bench: $(STAMP)  ## benchmarks: tables on stdout, JSON in bench/results/
	HF_HUB_OFFLINE=1 $(PY) bench/run_all.py

clean:
	rm -rf demo-runs fedmoe-data .pytest_cache artifacts
