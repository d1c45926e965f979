# Two entry points for a fresh machine:
#   make lab    set up and start JupyterLab on the quickstart notebook (CPU TensorFlow)
#   make test   set up (Python packages + Chromium) and run the whole suite, notebooks included
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What `make lab` installs (CPU TensorFlow and JupyterLab; `make lab EXTRAS=gpu,lab` for CUDA) and what
# `make test` installs (everything the suite exercises: JAX, PyTorch and ipyparallel too). One venv for both.
EXTRAS ?= cpu,lab
TEST_EXTRAS ?= cpu,lab,test,jax,torch,cluster,mpi
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
# The suite and the stored notebook outputs must not depend on the CPU's maker: TensorFlow turns oneDNN on by
# default only on some Intel CPUs, and only oneDNN's CPU allocator keeps the statistics %vgpu_status shows.
TEST_ENV := TF_CPP_MIN_LOG_LEVEL=2 TF_ENABLE_ONEDNN_OPTS=1

.PHONY: setup setup-test system-deps lab lint test test-fast bench clean notebooks gpu-check gpu-wheels

setup: $(VENV)/.installed-$(EXTRAS)
setup-test: $(VENV)/.installed-$(TEST_EXTRAS)

$(VENV)/.installed-%: pyproject.toml
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$*]'
	touch $@

# Debian's Chromium for the real-browser test (Playwright drives /usr/bin/chromium; it never downloads a
# browser of its own), OpenMPI's mpiexec for the ranks started through ipyparallel's MPI launcher, and
# SLURM, munge, sshd and iproute2 for the launcher tests (a single-node SLURM cluster and a second host in
# a network namespace, both started and removed by the tests; the system's own daemons are not used).
# Without them those tests are skipped with the reason.
system-deps:
	@missing=""; [ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	command -v mpiexec >/dev/null || missing="$$missing openmpi-bin"; \
	[ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] || missing="$$missing slurm-wlm"; \
	[ -x /usr/sbin/munged ] || missing="$$missing munge"; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v ssh >/dev/null || missing="$$missing openssh-client"; \
	[ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing="$$missing iproute2"; \
	if [ -z "$$missing" ]; then echo "system packages: chromium, mpiexec, slurm, munge, sshd and ip present"; \
	else $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing \
	  || echo "could not install$$missing: the tests that need them will be skipped"; fi

# Jupyter refuses to run as root unless told; containers and CI machines often are root.
ALLOW_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)
LAB_ARGS ?=

# The whole clone is JupyterLab's root (README, notebooks, scripts), with the quickstart open.
lab: setup
	TF_CPP_MIN_LOG_LEVEL=2 $(VENV)/bin/jupyter lab $(ALLOW_ROOT) --ServerApp.root_dir=. $(LAB_ARGS) notebooks/01_quickstart.ipynb

# ruff and import-linter's contracts (both configured in pyproject.toml: the layers of docs/architecture.md)
# run before the tests: a lint finding fails `make test` early.
lint: setup-test
	$(VENV)/bin/ruff check vgpu_magic tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

test: setup-test system-deps lint
	$(TEST_ENV) $(PY) -m pytest tests notebooks --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg $(PYTEST_ARGS)

# The suite without the browser test and notebooks, for quick iterations.
test-fast: setup-test lint
	$(TEST_ENV) $(PY) -m pytest tests -m "not browser" $(PYTEST_ARGS)

# Ratios and timings measured in one run (a few minutes; tests never assert on wall-clock time).
bench: setup-test
	$(TEST_ENV) $(PY) benchmarks/load_and_split.py
	$(TEST_ENV) $(PY) benchmarks/monitor_overhead.py
	$(TEST_ENV) $(PY) benchmarks/jax_split.py
	$(TEST_ENV) $(PY) benchmarks/cluster.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache artifacts

# Re-run the tutorial notebooks in place, storing fresh real outputs (what nbval checks against).
# PYTEST_CURRENT_TEST makes ipykernel leave C-level stderr (TensorFlow's timestamped C++ log lines) out of the
# cell outputs, exactly as it does under nbval, so the stored outputs match what the test run produces.
notebooks: setup-test
	for nb in notebooks/*.ipynb; do PYTEST_CURRENT_TEST=notebooks $(TEST_ENV) $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; done

# A machine with an NVIDIA GPU: every GPU test of the suite and the GPU estimates against the card's own
# counters, results in benchmarks/results/gpu.json (one line and exit 0 where there is no GPU). It needs only
# Python with torch and/or JAX there: what else the suite imports comes from .whl/ (`make gpu-wheels`).
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py

# On a machine with network access: the wheels a GPU machine without IPython/ipyparallel needs (Python 3.12,
# x86-64; about 16 MiB), into the git-ignored .whl/ that travels with the tree.
GPU_PYTHON ?= 3.12
gpu-wheels:
	$(PYTHON) -m pip download -q --dest .whl --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  ipython ipyparallel ipykernel cloudpickle psutil
