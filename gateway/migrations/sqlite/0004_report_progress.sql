-- The workload's last progress value as its owner last reported it.
ALTER TABLE instance_reports ADD COLUMN progress INTEGER NOT NULL DEFAULT 0;
