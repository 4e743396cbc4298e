-- oncely's consumption record. Applied by oncely::postgres::migrate, which substitutes the
-- validated, quoted {schema} and {table} names; every statement is idempotent.
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.{table} (
    id                  BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The business key; the unique index is the final backstop against a second effect.
    message_key         TEXT NOT NULL UNIQUE,
    status              TEXT NOT NULL CHECK (status IN ('PROCESSING', 'SUCCESS', 'FAILURE')),
    -- Attempts begun after the first: attempt number = retry_count + 1.
    retry_count         INTEGER NOT NULL DEFAULT 0,
    error_details       TEXT,
    -- XXH3-128 of the body, 32 hex digits: the same key with another payload is a conflict.
    payload_fingerprint TEXT NOT NULL,
    -- The lock's fencing token of the attempt that last wrote the row, if a lock ran.
    fencing_token       BIGINT,
    -- Until when a PROCESSING attempt holds the key (three-step mode).
    lease_until         TIMESTAMPTZ,
    created_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at          TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The reconciler's scan: PROCESSING rows whose lease ran out.
CREATE INDEX IF NOT EXISTS {processing_lease_index}
    ON {schema}.{table} (lease_until) WHERE status = 'PROCESSING';

-- The retention purge's scan: old SUCCESS rows.
CREATE INDEX IF NOT EXISTS {success_updated_index}
    ON {schema}.{table} (updated_at) WHERE status = 'SUCCESS';
