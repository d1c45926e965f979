# Two entry points for a fresh machine:
#   make lab    set up and start JupyterLab on the quickstart notebook (CPU TensorFlow)
#   make test   set up (Python packages + Chromium) and run the complete suite, notebooks included (the other
#               tiers: test-fast, test-anycpu, test-stress, test-fidelity, test-packaging, test-oldest, test-full)
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

.PHONY: setup setup-test system-deps lab lint test test-fast test-anycpu test-stress test-fidelity test-packaging test-oldest test-full bench clean notebooks gpu-check gpu-wheels

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

NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg

# The complete suite, notebooks included, with the stress loops short; the tiers below add what it leaves out.
# Two workers (pytest-xdist), each taking whole files: most of a serial run waits on the processes a test starts,
# and every shared thing a test needs (IPython profile, ports, SLURM, hosts, Jupyter) is its worker's own. Two, as
# CI has two cores: more would starve the tests whose subject is the fault policy's timing. A worker that crashes
# ends the run, its test failed: replaced, it would leave the session waiting forever (pytest-xdist#1378).
TEST_WORKERS ?= 2
test: setup-test system-deps lint
	$(TEST_ENV) $(PY) -m pytest tests notebooks $(NBVAL) -m "not packaging and not screenshot and not load" -n $(TEST_WORKERS) --dist loadfile \
	  --max-worker-restart=0 $(PYTEST_ARGS)

# The tests that start no fresh process (no slow test, no browser, no notebook), for quick iterations.
test-fast: setup-test lint
	$(TEST_ENV) $(PY) -m pytest tests -m "not slow and not browser" $(PYTEST_ARGS)

# Stored outputs and float expectations must not depend on the CPU's float kernels: the notebooks and the tests
# marked anycpu, again with each framework's CPU kernels at their most generic (PyTorch's default, TensorFlow
# without oneDNN, XLA at SSE4.2) and at AVX2 (`make test` ran them with the machine's own).
ANYCPU_KERNELS := "ATEN_CPU_CAPABILITY=default TF_ENABLE_ONEDNN_OPTS=0 XLA_FLAGS=--xla_cpu_max_isa=SSE4_2" \
	"ATEN_CPU_CAPABILITY=avx2 TF_ENABLE_ONEDNN_OPTS=1 XLA_FLAGS=--xla_cpu_max_isa=AVX2"
test-anycpu: setup-test system-deps
	for kernels in $(ANYCPU_KERNELS); do echo "== $$kernels"; \
	  env TF_CPP_MIN_LOG_LEVEL=2 $$kernels $(PY) -m pytest tests notebooks $(NBVAL) -m anycpu $(PYTEST_ARGS) || exit 1; done

# The stress loops at their full counts (`make test` runs a fifth of each), and the tests that load the machine on
# purpose (`make test` leaves them out: their busy loops starve the other worker's tests).
test-stress: setup-test system-deps
	$(TEST_ENV) $(PY) -m pytest tests -m "stress or load" --stress $(PYTEST_ARGS)

# torchrun's reference runs measured again (`make test` reads them back from ~/.cache/vgpu-magic-tests where their
# inputs, versions, CPU and float kernels are the same).
test-fidelity: setup-test system-deps
	$(TEST_ENV) $(PY) -m pytest tests -m fidelity --fidelity $(PYTEST_ARGS)

# A fresh environment built from binder/ runs the quickstart (minutes: it installs TensorFlow).
test-packaging: setup-test
	$(TEST_ENV) $(PY) -m pytest tests -m packaging $(PYTEST_ARGS)

# Each extra's lower bound in pyproject.toml (pinned in tests/oldest.txt; JAX's is the version `make test` runs), in
# a venv of its own: the tests that start no process (the contract tests of what we use of ipyparallel and torch
# among them), then one test on real ranks per framework.
OLDEST := .venv-oldest
OLDEST_RANKS := tests/test_cluster_frameworks.py::test_tensorflow_workers_match_plain_tf_config_processes \
	tests/test_cluster_torch.py::test_same_weights_as_torchrun
$(OLDEST)/.installed: pyproject.toml tests/oldest.txt
	[ -x $(OLDEST)/bin/python ] || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST)/bin/python -m pip install --quiet -c tests/oldest.txt -e '.[cpu,test,torch,cluster]'
	touch $@
test-oldest: $(OLDEST)/.installed
	$(TEST_ENV) $(OLDEST)/bin/python -m pytest tests -m "not slow and not browser" $(PYTEST_ARGS)
	$(TEST_ENV) $(OLDEST)/bin/python -m pytest $(OLDEST_RANKS) $(PYTEST_ARGS)

test-full: test test-anycpu test-stress test-fidelity test-packaging test-oldest

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
# cell outputs, so none is stored; nbval runs the notebooks in kernels started as users start theirs, which keep
# it, so a C-level line that reaches a user's notebook fails the suite (notebooks/conftest.py).
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
