# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# The first use creates .venv and installs surgery into it (editable) with its cli, test, sweeps, search,
# hf, timm, deploy and dev extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The torch/torchvision pair this machine's pip finds on disk; pyproject.toml keeps ranges.
TORCH_PIN := torch==2.14.1 torchvision==0.29.1

.PHONY: run test test-peers coverage lint docs docs-commands family-coverage bench tour clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[cli,test,sweeps,search,hf,timm,deploy,dev]' $(TORCH_PIN)
	touch $@

run: $(STAMP)  ## the headline recipe; pass extra overrides with ARGS="prune.amount=0.7"
	$(PY) -m surgery recipe=prune_resnet50 $(ARGS)

test: $(STAMP)  ## the whole test suite, on every core (pytest-xdist; tests sharing one process stay together)
	$(PY) -m pytest -q -n auto --dist loadgroup $(ARGS)

test-peers: $(STAMP)  ## the tests against the peers' own code: makes their venvs first (tens of minutes the first time)
	cd benchmarks && ../$(PY) -c "from peer_venvs import llama_cpp_tools, peer_python; \
		[peer_python(p) for p in ('llmcompressor', 'auto_round', 'llama_cpp')]; llama_cpp_tools()"
	$(PY) -m pytest -q -n auto --dist loadgroup -m peers $(ARGS)

coverage: $(STAMP)  ## the suite with line coverage of surgery/ (pytest-cov), summary printed, kept in build/coverage.json
	$(PY) -m pytest -q -n auto --dist loadgroup --cov=surgery --cov-report=term:skip-covered \
		--cov-report=json:build/coverage.json $(ARGS)

lint: $(STAMP)  ## ruff: lint and formatting (what the pre-commit hooks check)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

family-coverage: $(STAMP)  ## docs/models.md's table of every verb and export on each decoder family, checked (minutes)
	SURGERY_FAMILY_SWEEP=1 $(PY) -m pytest -q -n auto tests/test_family_coverage.py $(ARGS)

docs-commands: $(STAMP)  ## every command the docs quote, run as written (sweeps and full-size models: minutes)
	SURGERY_DOCS_COMMANDS=all $(PY) -m pytest -q -n auto tests/test_docs_examples.py -k runs_as_written $(ARGS)

docs: $(STAMP)  ## the documentation site, built strictly into build/site (never with -q: it hides warnings)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

bench: $(STAMP)  ## performance figures quoted in the docs
	$(PY) -m pip install --quiet -e '.[bench,deploy,hf]' $(TORCH_PIN)
	$(PY) benchmarks/bench_prune.py $(ARGS)
	$(PY) benchmarks/bench_quantize.py $(ARGS)
	$(PY) benchmarks/bench_intercept.py
	$(PY) benchmarks/bench_compile.py
	$(PY) benchmarks/bench_calibrated.py
	$(PY) benchmarks/bench_shrink.py
	$(PY) benchmarks/bench_deploy.py

tour: $(STAMP)  ## regenerate the docs' images (docs/images/) from real runs
	rm -rf build/tour
	$(PY) -m surgery recipe=prune_resnet50 model.name=resnet18 data.image_size=64 hydra.run.dir=build/tour/prune
	-$(PY) -m surgery -m recipe=prune_resnet50 model.name=resnet18 data.image_size=64 \
		prune.amount=0.1,0.3,0.5,0.7,0.9 hydra.sweep.dir=build/tour/sweep  # 0.9 fails its drift bound: exit 1
	mkdir -p docs/images
	cp build/tour/prune/sparsity.png build/tour/prune/drift.png build/tour/sweep/sweep.png docs/images/

clean:
	rm -rf $(VENV) outputs multirun
