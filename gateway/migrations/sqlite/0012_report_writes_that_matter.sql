-- A report that changes only a workload's progress counter (or its time) is not a change of
-- the pool: it no longer moves the write count, so replicas do not re-read every report many
-- times a second while workloads run (they read the counters on a slower clock instead).
DROP TRIGGER instance_reports_writes_update;

CREATE TRIGGER instance_reports_writes_update AFTER UPDATE ON instance_reports
    WHEN OLD.term IS NOT NEW.term
        OR OLD.member IS NOT NEW.member
        OR OLD.process_id IS NOT NEW.process_id
        OR OLD.phase IS NOT NEW.phase
        OR OLD.message IS NOT NEW.message
        OR OLD.workload_pid IS NOT NEW.workload_pid
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'instance_reports' AND backend = 0; END;
