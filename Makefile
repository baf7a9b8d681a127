# The README's two commands are `make demo` and `make test`; both set everything up first.
.PHONY: setup setup-demo demo test lint typecheck pytest cli-start bench clean

setup:
	@bash scripts/setup.sh

setup-demo:
	@bash scripts/setup.sh demo

demo: setup-demo
	.venv/bin/python -m pffs.demo

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck: setup
	@bash scripts/typecheck.sh

pytest: setup
	.venv/bin/python -m pytest -p no:cacheprovider

# The CLI's start-up times (bench/cli_start.py: printed, never asserted) close every test run's log.
cli-start: setup
	.venv/bin/python bench/cli_start.py --runs 5

test: lint typecheck pytest cli-start

bench: setup
	.venv/bin/python bench/sdk.py

clean:
	rm -rf build .venv .pytest_cache .mypy_cache .ruff_cache
