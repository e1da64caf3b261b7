# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU-only machines get the CPU build of torch; see README for CUDA.
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/pip install -q "torch==2.13.0" || \
	  $(BIN)/pip install -q "torch>=2.11,<2.15" --index-url https://download.pytorch.org/whl/cpu ; fi
	# the runtime package plus the test extra (elasticep_testkit's openai/httpx, pytest) and ruff
	$(BIN)/pip install -q -e '.[test,dev]'
	$(MAKE) etcd
	touch $(STAMP)

# etcd for --membership-store etcd:// and its tests (tests/test_etcd_membership.py start a
# 3-member cluster on 127.0.0.1): Debian's etcd-server, whose package starts no service
# here. The embedded coordinator, the default, needs none of it.
.PHONY: etcd
etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends etcd-server; }
	@etcd --version | head -1

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# Two pytest workers, one test file each at a time (most tests wait on the processes
# they started, so two files share the two cores); then the tests marked serial, alone
# (the network-namespace ones failed in setup beside another file).
test: $(STAMP) etcd
	$(BIN)/ruff check elasticep elasticep_testkit tests bench examples
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 -m "not serial" tests
	$(BIN)/python -m pytest -q --durations=5 -m serial tests

lint: $(STAMP)
	$(BIN)/ruff check elasticep elasticep_testkit tests bench examples

clean:
	rm -rf $(VENV)

# Every failover scenario, the elastic-vs-none overhead and a 5-trial chaos run, then
# docs/results.md with the numbers, the machine and the plots (about 20-30 min on 2 cores).
.PHONY: results
results: $(STAMP)
	$(BIN)/python -m bench.results
