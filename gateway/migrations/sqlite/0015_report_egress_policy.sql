-- The egress policy the owner's sidecar last said it enforces (runtime.v1.PolicyLoaded, via
-- host.v1 InstanceStatus.egress_policy): name, revision and why an install was not loaded.
-- NULL: nothing reported in this term. A change of them is a change of the pool (the
-- coordinator shows them in each SandboxPolicy's status). Old replicas write none of them.
ALTER TABLE instance_reports ADD COLUMN policy_name TEXT;
ALTER TABLE instance_reports ADD COLUMN policy_revision INTEGER;
ALTER TABLE instance_reports ADD COLUMN policy_error TEXT;

DROP TRIGGER instance_reports_writes_update;
CREATE TRIGGER instance_reports_writes_update AFTER UPDATE ON instance_reports
    WHEN OLD.term IS NOT NEW.term
        OR OLD.member IS NOT NEW.member
        OR OLD.process_id IS NOT NEW.process_id
        OR OLD.phase IS NOT NEW.phase
        OR OLD.message IS NOT NEW.message
        OR OLD.workload_pid IS NOT NEW.workload_pid
        OR OLD.policy_name IS NOT NEW.policy_name
        OR OLD.policy_revision IS NOT NEW.policy_revision
        OR OLD.policy_error IS NOT NEW.policy_error
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'instance_reports' AND backend = 0; END;
