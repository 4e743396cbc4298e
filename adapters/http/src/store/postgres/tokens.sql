-- oncely-http's one-time tokens: issued, unused tokens and whom they were issued to.
-- Applied by PgTokens::migrate, which substitutes the validated, quoted names; every
-- statement is idempotent.
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.{table} (
    token      TEXT PRIMARY KEY,
    -- The client the token was issued to; another client presenting it is refused.
    client     TEXT NOT NULL,
    issued_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at TIMESTAMPTZ NOT NULL
);

-- The purge's scan.
CREATE INDEX IF NOT EXISTS {expiry_index} ON {schema}.{table} (expires_at);
