-- oncely's entity state table for the state-machine guard on MySQL 8 / MariaDB 10.6+.
-- Applied by oncely::mysql::migrate_state, which substitutes the validated, quoted {table}
-- name; one statement, idempotent. Entity ids and states are compared byte for byte.
CREATE TABLE IF NOT EXISTS {table} (
    entity_id  VARBINARY(1024) NOT NULL PRIMARY KEY,
    status     VARBINARY(255) NOT NULL,
    -- Incremented by every transition, for compare-and-swap by version.
    version    BIGINT NOT NULL DEFAULT 1,
    updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC
