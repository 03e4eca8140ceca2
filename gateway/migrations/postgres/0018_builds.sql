-- Which build each part of the pool runs (docs/operate.md, "Versions and skew"): a gateway
-- replica (name: the replica), a member (name: the member), a sidecar (name: its route). Written
-- when a gateway starts and every few minutes, when a member attaches and when a sidecar
-- registers; read by the status. Expand-only: builds without it run on.
CREATE TABLE builds (
    component   TEXT   NOT NULL CHECK (component IN ('gateway', 'member', 'sidecar')),
    name        TEXT   NOT NULL,
    version     TEXT   NOT NULL,
    seen_at_ms  BIGINT NOT NULL,
    PRIMARY KEY (component, name)
);
