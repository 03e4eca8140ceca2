-- The workload's last progress value as its owner last reported it.
ALTER TABLE instance_reports ADD COLUMN progress BIGINT NOT NULL DEFAULT 0;
