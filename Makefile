# Two set-up commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv system-deps slurm-roots test test-fast test-stress lint demo bench bench-scale chaos benchmarks-doc gpu-check temporal-certs clean whatif

# Where make bench, make chaos and make bench-scale keep their last run's JSON (with its commit,
# date and machine), and what makes docs/benchmarks.md from them (bench/report.py).
RESULTS := docs/results
REPORT = $(BIN)/python -m bench.report --results $(RESULTS)

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

system-deps:
	scripts/system-deps.sh

# Slurm 24.11 and 26.05 for the lab and the tests: Debian roots made once (about a minute, as
# root) and cached in $$GPUFLEET_SLURM_ROOTS (default ~/.cache/gpufleet); REFRESH=1 checks them
# against Debian's archive now (else once a day) and remakes one whose packages moved.
slurm-roots: venv system-deps
	$(BIN)/python -m lab.slurmroots $(if $(REFRESH),--refresh)

# Two runs: the tests that start no Slurm daemon and no lab two at a time (pytest-xdist; each
# starts its own Temporal test server, kubeapi or sshd on free ports), then the Slurm and lab
# tests one at a time, since two labs must never run at once.
test: venv system-deps slurm-roots
	$(BIN)/pytest -q -n 2 -m "not slurm and not e2e and not whatif" --durations=15
	$(BIN)/pytest -q -m "slurm or e2e" --durations=30

test-fast: venv
	$(BIN)/pytest -q -n 2 -m "not slurm and not e2e and not whatif"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

demo: venv system-deps
	$(BIN)/gpufleet lab up
	$(BIN)/gpufleet lab drill
	@echo
	@echo "The lab keeps running: $(BIN)/gpufleet lab status | $(BIN)/gpufleet incidents list | stop it with $(BIN)/gpufleet lab down"

# Remediation on a bad day: worker kills at every step, outages, a hanging webhook, a race... (JSON last line,
# kept in $(RESULTS)/chaos.json). A failed run is kept and shown too, and still exits non-zero.
# FLAVOR=slinky: the slinky flavor's lab and scenarios (slurmrestd, the operator stand-in, pod-protect),
# kept in $(RESULTS)/chaos-slinky.json (not part of .ci/run).
CHAOS_JSON = chaos$(if $(filter-out default,$(FLAVOR)),-$(FLAVOR)).json
chaos: venv system-deps
	$(BIN)/python -m lab.chaos $(if $(SLURM),--slurm $(SLURM)) $(if $(FLAVOR),--flavor $(FLAVOR)) --output $(RESULTS)/$(CHAOS_JSON); status=$$?; $(REPORT) && exit $$status

# The what-if's full runs (not part of .ci/run, which runs its one-day case): a month of the llama3
# synthetic on 2,048 nodes through the real workflows, each policy and spare count (minutes).
whatif: venv
	$(BIN)/pytest -q -m whatif tests/sim --durations=5

# The whole suite three times from a fresh clone, with a CPU hog beside it (not part of .ci/run).
test-stress: venv system-deps
	scripts/test-stress.sh

# The detector's figures, K recovery drills (3), cluster creation and pool moves, as JSON ($(RESULTS)/bench.json).
# FLAVOR=slinky: the drills, a cluster created --backend slinky and pool moves on the lab's slinky flavor
# ($(RESULTS)/bench-slinky.json; the detector's figures skipped, saying why).
FLAVOR ?= default
bench: venv system-deps
	$(BIN)/python -m bench.bench --flavor $(FLAVOR) --drills $(or $(K),3) \
		--output $(RESULTS)/bench$(if $(filter-out default,$(FLAVOR)),-$(FLAVOR)).json
	$(REPORT)

# A burst of 1,000 Xids on a simulated fleet of 10,000 nodes (Slurm simulated, all else real), as JSON
# ($(RESULTS)/bench-scale.json).
bench-scale: venv
	$(BIN)/python -m bench.bench_scale --output $(RESULTS)/bench-scale.json $(ARGS)
	$(REPORT)

# docs/benchmarks.md from $(RESULTS)/*.json alone (the three targets above run it after their JSON).
benchmarks-doc: venv
	$(REPORT)

# On a machine with NVIDIA GPUs and a driver: the NVML source for 30 s, no false events expected;
# prints every GPU's degradation reading. EXPECT_GPUS=8: the GPUs the machine should have.
gpu-check: venv
	$(BIN)/python -m detector.gpu_check --seconds 30 --expect-gpus $(or $(EXPECT_GPUS),0)

# docker-compose.temporal.yml's certificates (mutual TLS to Temporal): a local CA, the server's
# and its clients' (scripts/temporal-certs.sh; DIR defaults to ./secrets/temporal-tls).
temporal-certs:
	scripts/temporal-certs.sh $(DIR)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
