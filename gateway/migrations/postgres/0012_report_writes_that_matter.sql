-- A report that changes only a workload's progress counter (or its time) is not a change of
-- the pool: it no longer moves the write count, so replicas do not re-read every report many
-- times a second while workloads run (they read the counters on a slower clock instead).
-- Row triggers: an upsert fires the statement triggers of INSERT and UPDATE whatever it did,
-- while AFTER ... FOR EACH ROW fires only for a row really inserted or really updated.
DROP TRIGGER instance_reports_writes ON instance_reports;

CREATE TRIGGER instance_reports_inserted AFTER INSERT ON instance_reports
    FOR EACH ROW EXECUTE FUNCTION count_pool_write();
CREATE TRIGGER instance_reports_changed AFTER UPDATE ON instance_reports
    FOR EACH ROW WHEN (
        OLD.term IS DISTINCT FROM NEW.term
        OR OLD.member IS DISTINCT FROM NEW.member
        OR OLD.process_id IS DISTINCT FROM NEW.process_id
        OR OLD.phase IS DISTINCT FROM NEW.phase
        OR OLD.message IS DISTINCT FROM NEW.message
        OR OLD.workload_pid IS DISTINCT FROM NEW.workload_pid
    ) EXECUTE FUNCTION count_pool_write();
CREATE TRIGGER instance_reports_deleted AFTER DELETE ON instance_reports
    FOR EACH STATEMENT EXECUTE FUNCTION count_pool_write();
