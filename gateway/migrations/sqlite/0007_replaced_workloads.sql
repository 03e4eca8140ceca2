-- The instance generation an assignment was made for. A route registered again by another
-- workload (a Pod recreated under the same name, with a new UID) makes the route's
-- assignment stale: the coordinator places the new workload anew at the next term.
ALTER TABLE assignments ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
-- The term at which that generation was placed; later terms of it are recoveries or moves.
ALTER TABLE assignments ADD COLUMN placed_term INTEGER NOT NULL DEFAULT 1;
UPDATE assignments SET generation = COALESCE(
    (SELECT i.generation FROM instances i WHERE i.route = assignments.route), 0);

-- Workloads (Pod UIDs) that a newer registration of their route replaced: they never
-- register, withdraw or report for the route again.
CREATE TABLE replaced_instances (
    route          TEXT   NOT NULL,
    uid            TEXT   NOT NULL,
    replaced_at_ms INTEGER NOT NULL,
    PRIMARY KEY (route, uid)
);
