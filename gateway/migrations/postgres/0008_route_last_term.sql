-- The highest ownership term ever assigned on the route, kept across withdrawals and
-- generations: an assignment dropped when its instance was withdrawn leaves it behind, so
-- the next placement of the route starts above it (terms, and the grant ledger's
-- (route, term) keys, never repeat).
ALTER TABLE instances ADD COLUMN last_term BIGINT NOT NULL DEFAULT 0;
UPDATE instances SET last_term = COALESCE((SELECT MAX(g.term) FROM grants g WHERE g.route = instances.route), 0);
UPDATE instances SET last_term = (SELECT a.term FROM assignments a WHERE a.route = instances.route)
    WHERE EXISTS (SELECT 1 FROM assignments a WHERE a.route = instances.route AND a.term > instances.last_term);
