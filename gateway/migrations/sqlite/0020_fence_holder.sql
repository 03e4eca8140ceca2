-- The member process whose activation set the fence a sidecar last registered
-- (RegisterRequest.fence_member / fence_process_id / fence_term), as the sidecar vouches for
-- it, and the instance's generation then. A store that lost a route's reservation, or the
-- whole instance, gives the route back only to that process, once it reports that very term
-- active (gateway/src/forgotten.rs): neither a member's word nor a sidecar's alone moves an
-- instance. Written only with a fence at or above the route's last term. Replicas of earlier
-- builds neither write nor read them (a generation they start leaves them, not matching).
ALTER TABLE instances ADD COLUMN fence_member TEXT;
ALTER TABLE instances ADD COLUMN fence_process_id TEXT;
ALTER TABLE instances ADD COLUMN fence_term INTEGER;
ALTER TABLE instances ADD COLUMN fence_generation INTEGER;
