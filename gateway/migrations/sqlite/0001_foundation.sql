-- Coordinator lease: one logged row. Term 0 with an expiry in the past means
-- "never held", so the first acquire locks an existing row and grants term 1.
CREATE TABLE coordinator_lease (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    holder        TEXT     NOT NULL,
    term          INTEGER   NOT NULL CHECK (term >= 0),
    expires_at_ms INTEGER   NOT NULL
);
INSERT INTO coordinator_lease (id, holder, term, expires_at_ms) VALUES (1, '', 0, 0);

-- Every term ever granted. The primary key makes two holders of one term impossible.
CREATE TABLE coordinator_terms (
    term           INTEGER PRIMARY KEY,
    holder         TEXT   NOT NULL,
    acquired_at_ms INTEGER NOT NULL
);

CREATE TABLE members (
    member          TEXT    PRIMARY KEY,
    process_id      TEXT    NOT NULL,
    epoch           INTEGER  NOT NULL,
    runtime_address TEXT    NOT NULL,
    capacity        INTEGER  NOT NULL CHECK (capacity >= 0),
    served_by       TEXT    NOT NULL,
    leaving         INTEGER NOT NULL,
    expires_at_ms   INTEGER  NOT NULL,
    updated_at_ms   INTEGER  NOT NULL
);

CREATE TABLE instances (
    route            TEXT   PRIMARY KEY,
    namespace        TEXT   NOT NULL,
    name             TEXT   NOT NULL,
    uid              TEXT   NOT NULL,
    generation       INTEGER NOT NULL,
    material         BLOB  NOT NULL,
    registered_at_ms INTEGER NOT NULL
);

CREATE TABLE assignments (
    route            TEXT   PRIMARY KEY,
    member           TEXT   NOT NULL,
    process_id       TEXT   NOT NULL,
    term             INTEGER NOT NULL CHECK (term > 0),
    phase            TEXT   NOT NULL CHECK (phase IN ('reserved', 'active')),
    coordinator_term INTEGER NOT NULL,
    updated_at_ms    INTEGER NOT NULL
);
CREATE INDEX assignments_by_member ON assignments (member);

CREATE TABLE operations (
    id               TEXT   PRIMARY KEY,
    kind             TEXT   NOT NULL CHECK (kind IN ('assign', 'recover', 'drain', 'rebalance')),
    target           TEXT   NOT NULL,
    phase            TEXT   NOT NULL CHECK (phase IN ('pending', 'running', 'succeeded', 'failed', 'cancelled')),
    message          TEXT   NOT NULL,
    attempts         INTEGER NOT NULL,
    moves            INTEGER NOT NULL,
    deadline_at_ms   INTEGER,
    max_parallel     INTEGER NOT NULL CHECK (max_parallel BETWEEN 1 AND 8),
    requested_by     TEXT   NOT NULL,
    coordinator_term INTEGER NOT NULL,
    created_at_ms    INTEGER NOT NULL,
    updated_at_ms    INTEGER NOT NULL
);
CREATE INDEX operations_open ON operations (phase) WHERE phase IN ('pending', 'running');

CREATE TABLE signing_keys (
    kid              TEXT   PRIMARY KEY,
    algorithm        TEXT   NOT NULL,
    public_pem       TEXT   NOT NULL,
    private_pem      BLOB  NOT NULL,
    coordinator_term INTEGER NOT NULL,
    created_at_ms    INTEGER NOT NULL,
    retired_at_ms    INTEGER
);
