-- An operator's cancellation, recorded by whichever replica served it; the coordinator
-- applies it with a fenced write.
ALTER TABLE operations ADD COLUMN cancel_requested_at_ms INTEGER;
-- At most one open drain per member and one open rebalance, whoever records them.
CREATE UNIQUE INDEX operations_one_open ON operations (kind, target)
    WHERE phase IN ('pending', 'running') AND kind IN ('drain', 'rebalance');
