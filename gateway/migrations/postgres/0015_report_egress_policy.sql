-- The egress policy the owner's sidecar last said it enforces (runtime.v1.PolicyLoaded, via
-- host.v1 InstanceStatus.egress_policy): name, revision and why an install was not loaded.
-- NULL: nothing reported in this term. A change of them is a change of the pool (the
-- coordinator shows them in each SandboxPolicy's status). Old replicas write none of them.
ALTER TABLE instance_reports ADD COLUMN policy_name TEXT;
ALTER TABLE instance_reports ADD COLUMN policy_revision BIGINT;
ALTER TABLE instance_reports ADD COLUMN policy_error TEXT;

DROP TRIGGER instance_reports_changed ON instance_reports;
CREATE TRIGGER instance_reports_changed AFTER UPDATE ON instance_reports
    FOR EACH ROW WHEN (
        OLD.term IS DISTINCT FROM NEW.term
        OR OLD.member IS DISTINCT FROM NEW.member
        OR OLD.process_id IS DISTINCT FROM NEW.process_id
        OR OLD.phase IS DISTINCT FROM NEW.phase
        OR OLD.message IS DISTINCT FROM NEW.message
        OR OLD.workload_pid IS DISTINCT FROM NEW.workload_pid
        OR OLD.policy_name IS DISTINCT FROM NEW.policy_name
        OR OLD.policy_revision IS DISTINCT FROM NEW.policy_revision
        OR OLD.policy_error IS DISTINCT FROM NEW.policy_error
    ) EXECUTE FUNCTION count_pool_write();
