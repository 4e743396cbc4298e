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

-- The transactional record's guard: its transaction may only be committed by the tier. A
-- handler that runs COMMIT itself would commit the keys' records before their effects (in a
-- batch, the records of the deliveries whose handlers have not run yet); its COMMIT fails
-- instead, and the transaction is rolled back. The tier marks its transactions 'open' and
-- sets 'committing' just before its own COMMIT; other writers set nothing and pass.
CREATE OR REPLACE FUNCTION {schema}.oncely_commit_guard() RETURNS trigger LANGUAGE plpgsql AS $guard$
BEGIN
    IF current_setting('oncely.transaction', true) = 'open' THEN
        RAISE EXCEPTION 'only oncely commits the transactional record''s transaction: a handler ran COMMIT';
    END IF;
    RETURN NULL;
END
$guard$;

DO $trigger$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = '{schema}.{table}'::regclass AND tgname = 'oncely_commit_guard') THEN
        CREATE CONSTRAINT TRIGGER oncely_commit_guard AFTER INSERT OR UPDATE ON {schema}.{table}
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.status = 'SUCCESS')
            EXECUTE FUNCTION {schema}.oncely_commit_guard();
    END IF;
END
$trigger$;
