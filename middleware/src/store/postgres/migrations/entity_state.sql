-- oncely's entity state table for the state-machine guard. Applied by
-- oncely::postgres::migrate_state, which substitutes the validated, quoted names.
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.{table} (
    entity_id  TEXT PRIMARY KEY,
    status     TEXT NOT NULL,
    -- Incremented by every transition, for compare-and-swap by version.
    version    BIGINT NOT NULL DEFAULT 1,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
