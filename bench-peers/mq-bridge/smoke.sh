#!/usr/bin/env bash
# Smoke test for mq-bridge-peer against the local RabbitMQ and PostgreSQL: a fresh schema and
# queue, N messages (default 1000, keep it ≤ 2000) with ~30 % duplicates, then the peer, then
# the doubled rows counted the way the main bench counts them. Extra arguments go to the peer
# (e.g. `./smoke.sh 1000 --dedup-key '${payload:orderId}'`).
# RECENT=k makes every duplicate copy one of the last k originals (duplicates close together).
set -euo pipefail
cd "$(dirname "$0")"
N=${1:-1000}; shift || true
AMQP=${AMQP:-amqp://guest:guest@127.0.0.1:5672/%2f}
DB=${DB:-postgres://postgres@127.0.0.1:5432/test}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/root/.cache/oncely/peer-target}
nice -n 19 cargo build --release -j1 --quiet
BIN=$CARGO_TARGET_DIR/release
RUN=mqbsmoke_$(date +%s)_$$
psql -q "$DB" -c "CREATE SCHEMA $RUN; CREATE TABLE $RUN.stock_moves (order_id TEXT NOT NULL)"
trap 'psql -q "$DB" -c "SET client_min_messages=warning; DROP SCHEMA $RUN CASCADE"' EXIT
echo "publisher: $("$BIN/publish" --amqp-addr "$AMQP" --queue "$RUN" --messages "$N" ${RECENT:+--recent $RECENT})"
echo "peer:      $("$BIN/mq-bridge-peer" --amqp-addr "$AMQP" --queue "$RUN" --database-url "$DB" \
  --schema "$RUN" --messages "$N" "$@")"
echo "rows: $(psql -tA "$DB" -c "SELECT count(*) FROM $RUN.stock_moves"), doubled order ids: $(psql -tA "$DB" \
  -c "SELECT count(*) FROM (SELECT order_id FROM $RUN.stock_moves GROUP BY 1 HAVING count(*)>1) d")"
echo "dedup table rows: $(psql -tA "$DB" -c "SELECT count(*) FROM $RUN.mqb_dedup")"
# The queue is left empty; delete it (mq-bridge declared it durable, so it would stay).
"$BIN/publish" --amqp-addr "$AMQP" --queue "$RUN" --messages 0 --delete >/dev/null
