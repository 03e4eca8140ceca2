-- Every replica records (database time) that it is running, every
-- timing::REPLICA_REFRESH. A member record served by a replica that stopped recording for
-- longer than timing::replica_silence_bound() is expired by the other replicas.
CREATE TABLE replicas (
    replica         TEXT   PRIMARY KEY,
    refreshed_at_ms BIGINT NOT NULL
);
