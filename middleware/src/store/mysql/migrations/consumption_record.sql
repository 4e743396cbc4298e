-- oncely's consumption record on MySQL 8 / MariaDB 10.6+ (InnoDB; the unique index on a
-- 1,024-byte key needs the DYNAMIC row format, the default since MySQL 5.7 / MariaDB 10.2). Applied by
-- oncely::mysql::migrate, which substitutes the validated, quoted {table} name; one
-- statement, idempotent, safe when several consumers start at once.
CREATE TABLE IF NOT EXISTS {table} (
    id                  BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    -- The business key, compared byte for byte: a VARCHAR under a PAD SPACE collation
    -- would take 'k' and 'k ' for one key. The unique index is the final backstop against
    -- a second effect.
    message_key         VARBINARY(1024) NOT NULL,
    status              VARCHAR(10) CHARACTER SET ascii NOT NULL,
    -- Attempts begun after the first: attempt number = retry_count + 1.
    retry_count         INT NOT NULL DEFAULT 0,
    error_details       TEXT NULL,
    -- XXH3-128 of the body, 32 hex digits: the same key with another payload is a conflict.
    payload_fingerprint CHAR(32) CHARACTER SET ascii NOT NULL,
    -- The lock's fencing token of the attempt that last wrote the row, if a lock ran.
    fencing_token       BIGINT NULL,
    -- Until when a PROCESSING attempt holds the key (three-step mode), on the server's clock
    -- in UTC (the store writes UTC_TIMESTAMP; the defaults below are for rows others write).
    lease_until         DATETIME(6) NULL,
    created_at          DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at          DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    UNIQUE KEY message_key (message_key),
    -- The reconciler's scan (PROCESSING rows past their lease) and the retention purge's
    -- (old SUCCESS rows).
    KEY status_lease (status, lease_until),
    KEY status_updated (status, updated_at),
    -- Unnamed: MySQL 8 wants a constraint's name unique in the whole database.
    CHECK (status IN ('PROCESSING', 'SUCCESS', 'FAILURE'))
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC DEFAULT CHARSET = utf8mb4
