# dsv41-exl3 developer and CI entry points. Every pulumi call runs in the environment of toolchain/env.sh.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

include toolchain/versions.env

help: ## this list
	@awk -F':.*## ' '/^[a-z-]+:.*## / { printf "  %-12s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

PYTHON ?= python3
VENV := venv
PY := $(VENV)/bin/python
# The venv is rebuilt when the requirements or the project's metadata change: its stamp is named after their hash.
REQ_HASH := $(shell cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)
VENV_STAMP := $(VENV)/.installed-$(REQ_HASH)
WITH_ENV := . toolchain/env.sh &&

.PHONY: stack move-state config-table help venv venv-next test-python toolchain plugins env lint typecheck test-unit test-engine test-sim test clean clean-cache demo demo-down \
	bench-heal bench-image bench-observability bench-doctor

venv: $(VENV_STAMP) ## the Python venv from the pinned requirements

$(VENV_STAMP): requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check --quiet -r requirements-dev.txt
	# The `dsv41-exl3` command: this clone installed editable, with the pinned setuptools above (no download).
	$(PY) -m pip install --disable-pip-version-check --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

# Builds (or finds) the CLI and plugins in the cache outside the tree, then installs both providers into
# PULUMI_HOME at the exact versions the Python SDKs request.
toolchain: venv ## build (or find in the cache) the Pulumi CLI and both providers
	bash toolchain/build.sh
	$(MAKE) --no-print-directory plugins

plugins:
	@$(WITH_ENV) for spec in docker:$(DOCKER_PROVIDER_VERSION) command:$(COMMAND_PROVIDER_VERSION); do \
	    name=$${spec%%:*}; version=$${spec#*:}; bin="$$DSV41_TOOLCHAIN_BIN/pulumi-resource-$$name"; \
	    dir="$$PULUMI_HOME/plugins/resource-$$name-v$$version"; \
	    if cmp -s "$$bin" "$$dir/pulumi-resource-$$name"; then \
	        echo "plugins: resource $$name $$version already installed in $$PULUMI_HOME"; \
	    else \
	        rm -rf "$$dir" "$$dir.lock"; \
	        pulumi plugin install resource "$$name" "$$version" --file "$$bin" --exact; \
	    fi; \
	done

# Usage: eval "$(make -s env)"
env: ## print the toolchain environment, for eval in your shell
	@bash toolchain/env.sh --print

config-table: venv ## rewrite README's config table from the keys' declarations
	$(PY) -m components.config.table

lint: venv ## ruff check, ruff format --check, shellcheck of the node scripts
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@scripts=$$(find components -name '*.sh' | sort); echo "shellcheck $$(echo $$scripts | wc -w) node scripts"; \
	  [ -z "$$scripts" ] || $(VENV)/bin/shellcheck --shell=sh --severity=style $$scripts

typecheck: venv ## mypy (strict on components/), then bench and sim; the program against PYTHON_NEXT's stdlib too
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy bench sim
	$(VENV)/bin/mypy --python-version $(PYTHON_NEXT)

# JUNIT_DIR (set by .ci/run): each tier writes its tests' times there, for the run's slowest-tests report.
junit = $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/$(1)$(JUNIT_TAG).xml)

# Two xdist workers (CI has two cores); xdist merges the workers' JUnit results into one file.
test-unit: venv ## pure logic and components under the recording mock, on two workers
	$(PY) -m pytest -n 2 -m "not engine and not sim" $(call junit,test-unit) tests bench

# The unit and engine tiers under the second Python (toolchain/versions.env PYTHON_NEXT, which toolchain/python.sh
# finds or builds), in a venv of its own. CI runs those two tiers there and the sim tier under the main venv's
# Python (the floor of requires-python); typecheck checks the code against both.
VENV_NEXT := venv-$(PYTHON_NEXT)
venv-next: ## the venv of the second Python (PYTHON_NEXT in toolchain/versions.env)
	@$(MAKE) --no-print-directory venv PYTHON="$$(bash toolchain/python.sh)" VENV=$(VENV_NEXT)

test-python: venv-next ## the unit and engine tiers under the second Python
	$(MAKE) --no-print-directory test-unit test-engine VENV=$(VENV_NEXT) JUNIT_TAG=-py$(PYTHON_NEXT)

# DSV41_REQUIRE_TOOLCHAIN turns the engine tests' "toolchain not built" skip into a failure.
# Hypothesis is not used there, and its plugin's late import trips a CPython 3.11.7 compiler bug after
# Automation API runs (SystemError "AST constructor recursion depth mismatch" at the terminal summary).
INTEGRATION_PYTEST := $(PY) -m pytest -p no:hypothesispytest
test-engine: toolchain ## the project's Pulumi CLI and providers
	$(WITH_ENV) DSV41_REQUIRE_TOOLCHAIN=1 $(INTEGRATION_PYTEST) -m "engine and not sim" $(call junit,test-engine) \
	    tests/integration tests/toolchain

# Needs root: starts a dockerd and an sshd per simulated node (sim/README.md).
test-sim: toolchain sim-up ## as root: end to end on the simulated cluster
	$(WITH_ENV) DSV41_REQUIRE_TOOLCHAIN=1 DSV41_REQUIRE_SIM=1 $(INTEGRATION_PYTEST) -m sim $(call junit,test-sim) \
	    tests/integration tests/toolchain

test: lint typecheck test-python test-sim ## everything CI runs after installing

# Stack state and its passphrase live outside the tree (toolchain/env.sh), as does the toolchain cache.
clean: ## remove the venv and tool caches (keeps .state/)
	rm -rf $(VENV) $(VENV_NEXT) .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +

# Usage: make stack STACK=sparks [FORCE=1] [HOSTS="user@head user@worker" [IDENTITY=~/.ssh/id_ed25519]
#        [KNOWN_HOSTS=file]]. Writes Pulumi.sparks.yaml (git-ignored), filled in by discovery of HOSTS when given,
# creates the stack, and stores IDENTITY's key as the encrypted ssh.privateKey.
stack: venv ## write Pulumi.$(STACK).yaml from the template (and discovery of HOSTS) and create the stack
	@test -n "$(STACK)" || { echo "make stack: STACK is required, e.g. make stack STACK=sparks" >&2; exit 2; }
	$(PY) -m components.stack_file --stack "$(STACK)" $(if $(FORCE),--force) $(if $(HOSTS),--hosts $(HOSTS)) \
	    $(if $(IDENTITY),--identity "$(IDENTITY)") $(if $(KNOWN_HOSTS),--known-hosts "$(KNOWN_HOSTS)")
	@$(WITH_ENV) pulumi stack select --create "$(STACK)" --non-interactive >/dev/null && \
	    echo "stack $(STACK) selected (state: $${PULUMI_BACKEND_URL})"
	@$(if $(IDENTITY),$(WITH_ENV) pulumi config set --stack "$(STACK)" --secret --path ssh.privateKey \
	    < "$(IDENTITY)" && echo "ssh.privateKey set from $(IDENTITY) (encrypted)",true)

move-state: ## move stacks kept in the clone (.state/backend, before 0.8) to the state directory outside it
	bash toolchain/move_state.sh

# Deletes this version's toolchain build (not Go's module and build caches, which other projects share).
clean-cache: ## remove this version's toolchain build
	@$(WITH_ENV) echo "removing $$DSV41_TOOLCHAIN_DIR" && rm -rf "$$DSV41_TOOLCHAIN_DIR"

# --- simulated cluster (sim/README.md): loopback nodes with their own dockerd + sshd, a registry, a hub
# stand-in and the stand-in image. Installs its Debian packages itself when missing (as root).
# `make sim-up SIM_NODES=4`; `make sim-down` stops it all and removes containers (the image cache stays).
.PHONY: sim-up sim-down sim-image record-real
SIM_NODES ?= 2

sim-up: venv ## start the simulated cluster (SIM_NODES=2)
	SIM_NODES=$(SIM_NODES) $(PY) -m sim.cluster up

sim-image: venv
	$(PY) -m sim.cluster image

sim-down: ## stop the simulated cluster, remove its containers
	$(PYTHON) -m sim.cluster down

# Real vLLM's logs, answers and exit codes as fixtures (tests/support/fixtures/real-vllm) the stand-in is held to.
record-real: toolchain ## record real vLLM's logs, answers and faults as fixtures (~14 min)
	@test -f .state/sim/sim.json || $(MAKE) --no-print-directory sim-up
	$(WITH_ENV) $(PY) -m sim.record
# --- end simulated cluster

# --- demo on the simulated cluster: `make demo` brings everything up and deploys the `sim` stack to a verified
# endpoint; `make demo-down` destroys the stack and stops the cluster.
demo: toolchain ## deploy the sim stack to a verified endpoint
	$(MAKE) --no-print-directory sim-up
	$(WITH_ENV) $(PY) -m sim.stack init --stack sim && \
	    pulumi up --stack sim --yes --non-interactive --skip-preview && \
	    echo "endpoint: $$(pulumi stack output --stack sim endpoint)" && \
	    pulumi stack output --stack sim verification --json

demo-down: ## destroy the sim stack, stop the cluster
	-$(WITH_ENV) pulumi destroy --stack sim --yes --non-interactive
	$(MAKE) --no-print-directory sim-down

# --- benchmarks (issues 6, 11, 14): `make bench` deploys the real program (`pulumi up`/`preview` of this
# directory) on the simulated cluster and writes bench/results.json and BENCHMARKS.md (bench/run.py;
# `$(PY) -m bench.run --render` redraws the latter). It uses sim nodes 5..12, starting those not running, and
# never shrinks a running sim (sim-up only when there is none).
.PHONY: bench
bench: toolchain ## as root, ~21 min: the benchmarks -> BENCHMARKS.md
	@test -f .state/sim/sim.json || $(MAKE) --no-print-directory sim-up
	$(PY) -m pytest -p no:hypothesispytest -q bench
	$(WITH_ENV) nice -n 5 $(PY) -m bench.run

# doctor_s: `dsv41-exl3 doctor` on a two-node sim stack, nothing deployed (bench/doctor.py; the sim's nodes 1-2).
bench-doctor: toolchain ## the doctor's time on sim nodes 1-2
	@test -f .state/sim/sim.json || $(MAKE) --no-print-directory sim-up
	$(WITH_ENV) $(PY) -m bench.doctor

# heal_s: a killed worker until the supervisor verified again (bench/heal.py; the sim's nodes 1-2).
bench-heal: toolchain ## the supervisor's heal time on sim nodes 1-2
	@test -f .state/sim/sim.json || $(MAKE) --no-print-directory sim-up
	$(WITH_ENV) $(PY) -m bench.heal
bench-image: toolchain ## how long an image change leaves the endpoint silent, against the boot, on sim nodes 1-2
	@test -f .state/sim/sim.json || $(MAKE) --no-print-directory sim-up
	$(WITH_ENV) $(PY) -m bench.image_change
bench-observability: toolchain ## the observability layer's memory on the head over a 10-min scrape run, its no-op up cost
	@test -f .state/sim/sim.json || $(MAKE) --no-print-directory sim-up
	$(WITH_ENV) $(PY) -m bench.observability --minutes 10
# --- end benchmarks
