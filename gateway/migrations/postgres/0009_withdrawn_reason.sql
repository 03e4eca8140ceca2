-- Why an instance was withdrawn, when it was more than "no longer desired": 'recovery_failed'
-- when its sidecar stopped the workload at the recovery deadline (no supervisor took it over
-- in time), with the assignment it last had (owner member, term) when that was reported. The
-- coordinator's Kubernetes writer turns it into an Event on the workload's Pod, whichever
-- replica served the report. NULL for a deregistration, a Pod gone, or a desired instance.
ALTER TABLE instances ADD COLUMN withdrawn_reason TEXT;
ALTER TABLE instances ADD COLUMN withdrawn_owner TEXT;
ALTER TABLE instances ADD COLUMN withdrawn_term BIGINT;
