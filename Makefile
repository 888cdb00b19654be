# Two commands from a fresh clone: `make demo` and `make test`. Each sets up .venv itself.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
EDGETP := $(VENV)/bin/edgetp
CACHE ?= $(or $(EDGETP_CACHE_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/edgetp)
WHEELS := $(CACHE)/wheels
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: demo test bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base tools/llama_cpp_wheel.sh tools/apt-packages.txt
	tools/apt_install.sh
	$(PY) -m pip install -q -e '.[test]'
	tools/llama_cpp_wheel.sh $(PY) $(WHEELS)
	touch $@

demo: $(VENV)/.base
	$(PY) tools/demo.py

test: $(VENV)/.test
	$(EDGETP) model pull smollm2
	$(PY) tools/run_suite.py

bench: $(VENV)/.test
	$(PY) tools/bench_local.py

clean:
	rm -rf $(VENV) .pytest_cache

# kernels, stories260K text and tensor parallelism on arm64 under qemu-user (root; no .venv needed;
# the Debian arm64 rootfs is built once and cached under $(CACHE)/arm64). Not part of `make test`.
.PHONY: test-arm64
test-arm64:
	EDGETP_CACHE_DIR=$(CACHE) tools/arm64_testbed.sh
