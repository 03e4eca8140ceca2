-- The owner a recovery displaced because the gateways lost it (not one that gave its term up):
-- its member, process and the term it held active, and the term of the reservation that
-- displaced it. Written with that reservation (carried to the next one if it fails before an
-- activation); the next activation clears it. If that same process attaches again while that
-- very reservation is still not activated, it was cut off from the gateways, not gone, and
-- still serves the instance: the route is reserved anew for it (gateway/src/returned.rs).
-- Replicas of earlier builds neither write nor read them.
ALTER TABLE instances ADD COLUMN displaced_member TEXT;
ALTER TABLE instances ADD COLUMN displaced_process_id TEXT;
ALTER TABLE instances ADD COLUMN displaced_term BIGINT;
ALTER TABLE instances ADD COLUMN displaced_for BIGINT;
