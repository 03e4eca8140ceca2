-- When an instance was withdrawn (database time, ms): withdrawn instances and replaced
-- workloads are forgotten once no decision needs them (coordinator::RETIRED_RETENTION, by the
-- coordinator's fenced ForgetRetired write). Rows withdrawn before this column existed count
-- as withdrawn now, so none is forgotten before the retention has passed.
ALTER TABLE instances ADD COLUMN withdrawn_at_ms BIGINT;
UPDATE instances SET withdrawn_at_ms = CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER) WHERE withdrawn;
