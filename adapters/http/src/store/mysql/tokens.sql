-- oncely-http's one-time tokens on MySQL 8 / MariaDB 10.6+: issued, unused tokens and whom
-- they were issued to. Applied by MysqlTokens::migrate, which substitutes the validated,
-- quoted {table} name; one statement, idempotent.
CREATE TABLE IF NOT EXISTS {table} (
    -- Byte for byte: no collation folds case or pads spaces.
    token      VARBINARY(64) NOT NULL PRIMARY KEY,
    -- The client's scope the token was issued to; another client presenting it is refused.
    client     VARBINARY(64) NOT NULL,
    -- UTC, as the store writes it.
    issued_at  DATETIME(6) NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    KEY expires_at (expires_at)
) ENGINE = InnoDB
