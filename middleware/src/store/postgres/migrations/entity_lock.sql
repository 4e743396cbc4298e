-- oncely's lock table for the lock tier on PostgreSQL (PgLockStore). Applied by
-- oncely::postgres::migrate_lock, which substitutes the validated, quoted names.
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.{table} (
    entity        TEXT PRIMARY KEY,
    -- The holder's token (32 hex digits); NULL once released.
    holder        TEXT NULL,
    -- The last fencing token handed out for the entity. The row outlives every holder, so
    -- tokens only grow; a new entity starts from the clock in microseconds, above tokens a
    -- Redis lock may have handed out before.
    fencing_token BIGINT NOT NULL,
    -- Until when the holder holds it, on the server's clock.
    lease_until   TIMESTAMPTZ NULL
);
