-- The grant ledger: at most one recovery grant per reserved (route, term);
-- a second IssueGrant for the same reservation is refused, even after a lost
-- response. Activation checks the receipt against the row.
CREATE TABLE grants (
    route         TEXT   NOT NULL,
    term          INTEGER NOT NULL,
    jti           TEXT   NOT NULL UNIQUE,
    member        TEXT   NOT NULL,
    process_id    TEXT   NOT NULL,
    digest        BLOB  NOT NULL,
    issued_at_ms  INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    PRIMARY KEY (route, term)
);

-- The workload identity recorded at activation: every later activation must
-- present the same process (pid, start time, executable digest).
ALTER TABLE instances ADD COLUMN checkpoint_pid INTEGER;
ALTER TABLE instances ADD COLUMN checkpoint_start_ticks INTEGER;
ALTER TABLE instances ADD COLUMN checkpoint_exe_digest BLOB;
