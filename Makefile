# oncely's commands. `make test` is the one test command; CI runs it through .ci/run.
CARGO ?= cargo
SHELL := bash
.SHELLFLAGS := -eo pipefail -c

.PHONY: demo test fmt lint services bench

## The zero-setup quickstart: the whole stack on in-memory stores, no servers.
demo:
	$(CARGO) run --release -p quickstart

## Format check, clippy with warnings denied, every test, and the quickstart's own checks.
## Ends with one line totalling every cargo test binary: "tests: N passed, N failed".
test: fmt lint services
	log=$$(mktemp); trap 'rm -f "$$log"' EXIT; \
	$(CARGO) test --workspace --all-features 2>&1 | tee "$$log"; \
	$(CARGO) run -q -p quickstart; \
	awk '/^test result:/ { passed += $$4; failed += $$6 } \
	     END { printf "tests: %d passed, %d failed\n", passed, failed }' "$$log"

fmt:
	$(CARGO) fmt --all -- --check

lint:
	$(CARGO) clippy --workspace --all-targets --all-features -- -D warnings

## Detects, starts or installs the services the integration tests need (Redis, PostgreSQL,
## RabbitMQ, RocketMQ's Rust name server and broker).
services:
	integration-tests/services.sh

## Every benchmark, each tier against the raw limit of its own store, in one run.
bench: services
	$(CARGO) run --release -p integration-tests --bin bench -- all
