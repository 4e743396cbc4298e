-- oncely-http's stored responses: the answer each completed key gets again. Applied by
-- PgResponses::migrate, which substitutes the validated, quoted names; every statement is
-- idempotent. Rows are written in the record's transaction, so a key's row exists exactly
-- when its record committed.
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.{table} (
    -- The record's business key: the client's scope and its Idempotency-Key.
    message_key TEXT PRIMARY KEY,
    status      SMALLINT NOT NULL,
    -- The stored headers, one `name: value` line each, CRLF-terminated.
    headers     BYTEA NOT NULL,
    body        BYTEA NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at  TIMESTAMPTZ NOT NULL
);

-- The purge's scan.
CREATE INDEX IF NOT EXISTS {expiry_index} ON {schema}.{table} (expires_at);
