.PHONY: help setup train seeds test test-fast lint docs docs-build clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

setup:  ## create .venv with torch and rlhf (editable, with test tools)
	bash scripts/setup.sh

train: setup  ## the main job: DPO with Lion on the embedded default
	.venv/bin/python train.py algo=dpo optimizer=lion

seeds: setup  ## the main job over seeds 0-4 and the range of its results (SEEDS=0-9 for more)
	.venv/bin/python scripts/seeds.py --seeds $${SEEDS:-0-4}

test: setup  ## the whole test suite, as CI runs it: parallel tests, then those that start processes
	.venv/bin/python -m pytest -n 2 --dist loadfile -m "not serial" tests && .venv/bin/python -m pytest -m serial tests

test-fast: setup  ## the suite without the slow "it learns" tests
	.venv/bin/python -m pytest -n 2 --dist loadfile -m "not slow and not serial" tests

lint: setup  ## ruff, and the package's layers (lint-imports)
	.venv/bin/ruff check .
	.venv/bin/lint-imports

docs: setup  ## serve the documentation site at http://127.0.0.1:8000 (rebuilt on every change)
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve

docs-build: setup  ## build the site into site/ as CI does (strict: a broken link fails it)
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

clean:  ## remove run outputs (keeps .venv)
	rm -rf outputs/2* outputs/multirun .ci-cache
