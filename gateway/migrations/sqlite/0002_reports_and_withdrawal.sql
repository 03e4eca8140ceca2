-- A withdrawn instance keeps its row, so generations keep growing per route
-- even when a workload of the same name comes back later.
ALTER TABLE instances ADD COLUMN withdrawn INTEGER NOT NULL DEFAULT 0;

-- The latest status an owner reported for a route, attributed to a term only
-- after the owner acknowledged the snapshot revision that installed it.
CREATE TABLE instance_reports (
    route         TEXT   PRIMARY KEY,
    term          INTEGER NOT NULL,
    member        TEXT   NOT NULL,
    process_id    TEXT   NOT NULL,
    phase         TEXT   NOT NULL,
    message       TEXT   NOT NULL,
    workload_pid  INTEGER NOT NULL,
    reported_by   TEXT   NOT NULL,
    updated_at_ms INTEGER NOT NULL
);
