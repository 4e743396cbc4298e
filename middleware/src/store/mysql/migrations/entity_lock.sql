-- oncely's lock table for the lock tier on MySQL 8 / MariaDB 10.6+ (MysqlLockStore).
-- Applied by oncely::mysql::migrate_lock, which substitutes the validated, quoted {table}
-- name; one statement, idempotent. Entities are compared byte for byte.
CREATE TABLE IF NOT EXISTS {table} (
    entity        VARBINARY(1024) NOT NULL PRIMARY KEY,
    -- The holder's token (32 hex digits); NULL once released.
    holder        CHAR(32) CHARACTER SET ascii NULL,
    -- The last fencing token handed out for the entity. The row outlives every holder, so
    -- tokens only grow; a new entity starts from the clock in microseconds, above tokens a
    -- Redis lock may have handed out before.
    fencing_token BIGINT NOT NULL,
    -- Until when the holder holds it, on the server's clock in UTC.
    lease_until   DATETIME(6) NULL
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC
