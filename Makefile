# The README's two commands are `make demo` and `make test`; both set everything up first.
.PHONY: setup setup-demo demo test lint typecheck pytest cli-start bench clean

setup:
	@bash scripts/setup.sh

setup-demo:
	@bash scripts/setup.sh demo

demo: setup-demo
	.venv/bin/python -m pffs.demo

# The native core's Rust (native/): rustup's cargo, and the target folder scripts/setup.sh builds in.
CARGO ?= $(shell command -v cargo 2>/dev/null || echo $(HOME)/.cargo/bin/cargo)
export CARGO_TARGET_DIR ?= $(HOME)/.cache/pffs-tools/cargo-target

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	cd native && $(CARGO) fmt --check
	cd native && $(CARGO) clippy --locked --all-targets -q -- -D warnings
	cd native && $(CARGO) test --locked -q -p pffs-core

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
