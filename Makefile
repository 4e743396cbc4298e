# oncely's commands. `make test` is the one test command; CI runs it through .ci/run.
CARGO ?= cargo
# Where cargo builds; `make test` runs the chaos binary that `cargo test` built there.
TARGET_DIR ?= $(or $(CARGO_TARGET_DIR),target)
SHELL := bash
# RabbitMQ 4.0, which `make chaos` also runs against (services.sh starts it).
AMQP_ADDR_4 ?= amqp://guest:guest@127.0.0.1:5673/%2f
.SHELLFLAGS := -eo pipefail -c

.PHONY: demo test fmt lint doc services msrv package bench chaos fuzz

## The zero-setup quickstart: the whole stack on in-memory stores, no servers.
demo:
	$(CARGO) run --release -p quickstart

## A short fault-injection ledger run for `make test`: a few thousand messages, a few faults of
## each kind — handler faults on 2 % of calls each and two poison messages, so that every
## kind fires at least once (the run fails if one never does). `make chaos` is the full one.
CHAOS_SHORT = --messages 4000 --keys 800 --rate 400 --fault-every-ms 800 --handler-faults 2 --poison 2 \
	--time-limit-s 300
## The same through RocketMQ, smaller and slower (its retries come back after 10 s at the
## earliest, and a broker restart keeps its clients away for 30 s): one broker restart, the
## other faults every second, the same handler faults and poison messages.
CHAOS_SHORT_ROCKETMQ = --broker rocketmq --messages 2000 --keys 400 --rate 50 --fault-every-ms 1000 \
	--handler-faults 2 --poison 2 --time-limit-s 300

## The short run with every connection of the consumers on TLS (amqps, rediss, MariaDB with
## VERIFY_IDENTITY, PostgreSQL's require; `services.sh tls` starts the listeners): shorter
## still, the record batched on MariaDB, where TLS adds the most round trips' cost.
CHAOS_SHORT_TLS = --tls --store mysql --stack batched --messages 2000 --keys 400 --rate 400 \
	--fault-every-ms 800 --handler-faults 2 --poison 2 --time-limit-s 300

## Format check, clippy and rustdoc with warnings denied, every test, the quickstart's own checks, the
## README's first consumer (as the README runs it: its report alone on stdout, its logs on
## stderr), `amqp-orders` with the record on MariaDB (it exits non-zero if an order was applied
## twice), the payment-callback driver (non-zero if an order was
## credited twice or never) and the short chaos runs (RabbitMQ with the record per delivery at
## prefetch 16 and batched at the runner's default prefetch, as users run it; the same two on
## MariaDB, both at 16; then RocketMQ; then every consumer connection on TLS, the record batched
## on MariaDB), and the crates packaged as the registry would take them (`make package`).
## Ends with one line totalling every cargo test binary: "tests: N passed, N failed".
test: msrv fmt lint doc services package
	log=$$(mktemp); trap 'rm -f "$$log" "$$log.report"' EXIT; \
	$(CARGO) test --workspace --all-features 2>&1 | tee "$$log"; \
	$(CARGO) run -q -p quickstart; \
	$(CARGO) run -q -p first-consumer --bin send-red-packets; \
	$(CARGO) run -q -p first-consumer 2>/dev/null > "$$log.report"; cat "$$log.report"; \
	  if grep -q -e 'WARN' -e 'INFO' "$$log.report"; then echo "first-consumer logs on stdout"; exit 1; fi; \
	  tr -s ' ' < "$$log.report" | \
	  grep -c -e '^drained' -e '^ processed 100$$' -e '^ duplicates 30 ' -e '^ dead letters 1 (bad_body 1)$$' | grep -qx 4; \
	$(CARGO) run -q -p amqp-orders --bin publisher -- 200; \
	RECORD_STORE=mysql $(CARGO) run -q -p amqp-orders --bin consumer -- --drain; \
	$(CARGO) run -q -p payment-callback --bin driver -- --serve; \
	$(TARGET_DIR)/debug/chaos $(CHAOS_SHORT); \
	$(TARGET_DIR)/debug/chaos $(CHAOS_SHORT) --stack batched --default-prefetch; \
	$(TARGET_DIR)/debug/chaos $(CHAOS_SHORT) --store mysql; \
	$(TARGET_DIR)/debug/chaos $(CHAOS_SHORT) --store mysql --stack batched; \
	$(TARGET_DIR)/debug/chaos $(CHAOS_SHORT_ROCKETMQ); \
	$(TARGET_DIR)/debug/chaos $(CHAOS_SHORT_TLS); \
	awk '/^test result:/ { passed += $$4; failed += $$6 } \
	     END { printf "tests: %d passed, %d failed\n", passed, failed }' "$$log"

fmt:
	$(CARGO) fmt --all -- --check

## Clippy on everything, and on oncely's default features as the registry builds them (a
## batch counter once warned there); and each SQL store's feature alone, which must build
## without the other (the `mysql` feature alone once did not).
lint:
	$(CARGO) clippy --workspace --all-targets --all-features -- -D warnings
	$(CARGO) clippy -q -p oncely -- -D warnings
	$(CARGO) check -q -p oncely --no-default-features --features postgres
	$(CARGO) check -q -p oncely --no-default-features --features mysql
	$(CARGO) check -q -p oncely-http --no-default-features --features mysql

## The docs as docs.rs builds them (every feature) and as a default build shows them: any
## rustdoc warning, such as a link to an item behind a feature, fails.
doc:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --workspace --all-features

## The manifests' rust-version is checked by building with it: `make test` builds and tests on
## that toolchain, or checks the workspace with it when rustup has it beside a newer one;
## otherwise it fails, since a newer toolchain would hide a use of a newer API.
msrv:
	@want=$$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml); \
	have=$$($(CARGO) --version | sed -E 's/^cargo ([0-9]+\.[0-9]+).*/\1/'); \
	if [ "$$want" = "$$have" ]; then echo "rust-version $$want: the toolchain make test builds with"; \
	elif rustup run "$$want" cargo --version >/dev/null 2>&1; then \
	  rustup run "$$want" cargo check --workspace --all-features --all-targets; \
	else echo "rust-version $$want unverified: cargo is $$have and rustup has no $$want"; exit 1; fi

## The crates as the registry would take them: `cargo publish --dry-run` packages each
## publishable crate (licence files, readme, metadata), resolves its dependencies from
## crates.io — oncely's own crates from their packaged copies — and builds the packages.
package:
	$(CARGO) publish --dry-run --workspace --allow-dirty --quiet

## Detects, starts or installs the services the integration tests need (Redis, PostgreSQL,
## MariaDB, RabbitMQ 3 and 4, RocketMQ's Rust name server and broker).
services:
	integration-tests/services.sh

## The property tests over every parser a client or producer feeds (the Idempotency-Key
## header, one-time tokens, key templates and JSON pointers, the canonical-JSON fingerprint,
## AMQP headers, RocketMQ properties) at FUZZ_CASES generated inputs each instead of the 256
## `make test` runs. Each property's count is printed as it passes.
FUZZ_CASES ?= 100000
fuzz:
	PROPTEST_CASES=$(FUZZ_CASES) $(CARGO) test --release -p oncely -p oncely-http -p oncely-amqp \
	  -p oncely-rocketmq --all-features --lib -- prop_ --test-threads 2 2>&1 | \
	  sed -n 's/^test \(.*prop_[a-z0-9_]*\) \.\.\. ok$$/$(FUZZ_CASES) inputs: \1 ok/p; /FAILED\|panicked\|minimal failing/p'

## Every benchmark, each tier against the raw limit of its own store, in one run. With
## LONG=1, then a million messages through the RabbitMQ runner's full stack, its throughput
## and memory sampled every 10 s (`--long`; the plot in benchmarks-long.svg).
## The `amqp` benchmark's peer, mq-bridge 1.3 (bench-peers/mq-bridge), is a workspace of its
## own, built here first (a few minutes the first time) and named to the bench in MQ_BRIDGE_PEER.
bench: services
	$(CARGO) build --release --manifest-path bench-peers/mq-bridge/Cargo.toml --target-dir $(TARGET_DIR)/peers
	MQ_BRIDGE_PEER=$(abspath $(TARGET_DIR)/peers/release/mq-bridge-peer) \
	  $(CARGO) run --release -p integration-tests --bin bench -- all $(if $(LONG),--long)

## The fault-injection ledger run: 50,000 messages over 10,000 keys and 5 poison messages
## through four consumers in two processes (on RabbitMQ 3.10, then again on 4.0) while consumers are killed, Redis restarted and
## flushed, PostgreSQL and AMQP connections dropped, and the handler panics, times out or
## swallows a failed statement on 0.5 % of calls each; then the same with the record batched,
## its runners at prefetch 16 and again at the runner's default (512);
## then both again with the record on MariaDB (`MYSQL_URL`), its sessions ended with `KILL`;
## then the same through the red-packet shape (the flag with the record behind it, the record, no lock); then with the Redis flag
## alone; then 10,000 messages over 2,000 keys through RocketMQ on the rocketmq-points stack,
## with the broker restarted instead of connections dropped. Each report says how long the
## consumers took to drain after the last consumer kill. Fails if a full stack misses,
## doubles or half-applies a key, does not dead-letter a poison message, or stalls for a
## 5-second window.
chaos: services
	$(CARGO) build --release -p integration-tests --bins
	$(TARGET_DIR)/release/chaos
	AMQP_ADDR=$(AMQP_ADDR_4) $(TARGET_DIR)/release/chaos
	$(TARGET_DIR)/release/chaos --stack batched
	$(TARGET_DIR)/release/chaos --stack batched --default-prefetch
	$(TARGET_DIR)/release/chaos --store mysql
	$(TARGET_DIR)/release/chaos --store mysql --stack batched
	$(TARGET_DIR)/release/chaos --stack flag-record
	$(TARGET_DIR)/release/chaos --stack flag-only --report-only
	$(TARGET_DIR)/release/chaos --broker rocketmq
