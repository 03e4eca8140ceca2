-- When the coordinator of a term made its first fenced write (its start).
ALTER TABLE coordinator_terms ADD COLUMN started_at_ms BIGINT;
