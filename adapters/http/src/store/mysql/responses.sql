-- oncely-http's stored responses on MySQL 8 / MariaDB 10.6+, beside the record table whose
-- keys they answer. Applied by MysqlResponses::migrate, which substitutes the validated,
-- quoted {table} name; one statement, idempotent. Rows are written in the record's XA
-- transaction, so a key's row exists exactly when its record committed.
CREATE TABLE IF NOT EXISTS {table} (
    -- The record's business key, byte for byte, as the record table keeps it.
    message_key VARBINARY(1024) NOT NULL PRIMARY KEY,
    status      SMALLINT NOT NULL,
    -- The stored headers, one `name: value` line each, CRLF-terminated.
    headers     BLOB NOT NULL,
    -- Up to 16 MiB; the layer stores at most 1 MiB unless configured otherwise.
    body        MEDIUMBLOB NOT NULL,
    -- UTC, as the store writes it.
    expires_at  DATETIME(6) NOT NULL,
    KEY expires_at (expires_at)
) ENGINE = InnoDB
