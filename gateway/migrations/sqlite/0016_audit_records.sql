-- The egress audit trail: each decision a workload's sidecar recorded, stored once per
-- (Pod UID, sequence) as its owner delivered it (host.v1 RecordAudit), with the owner (member,
-- term) and when it was stored. Kept 7 days (the coordinator's retention round).
CREATE TABLE audit_records (
    uid            TEXT   NOT NULL,
    sequence       BIGINT NOT NULL,
    route          TEXT   NOT NULL,
    namespace      TEXT   NOT NULL,
    name           TEXT   NOT NULL,
    member         TEXT   NOT NULL,
    term           BIGINT NOT NULL,
    recorded_at_ms BIGINT NOT NULL,
    at_ms          BIGINT NOT NULL,
    decision       TEXT   NOT NULL,
    destination    TEXT   NOT NULL,
    method         TEXT   NOT NULL,
    path           TEXT   NOT NULL,
    rule           TEXT   NOT NULL,
    policy         TEXT   NOT NULL,
    revision       BIGINT NOT NULL,
    reason         TEXT   NOT NULL,
    bytes_sent     BIGINT NOT NULL,
    bytes_received BIGINT NOT NULL,
    duration_ms    BIGINT NOT NULL,
    PRIMARY KEY (uid, sequence)
);
CREATE INDEX audit_records_by_pod ON audit_records (namespace, name, sequence);
CREATE INDEX audit_records_by_age ON audit_records (recorded_at_ms);
