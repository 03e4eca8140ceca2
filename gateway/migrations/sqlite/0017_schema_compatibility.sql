-- Which builds may run against this schema (docs/development.md, "Migrations"): a build whose
-- newest migration is at least `oldest_reader` reads and writes it correctly, also when a newer
-- build applied migrations it does not know (expand-only changes: added tables, columns with
-- defaults, triggers). A migration that an older build cannot live with raises it to its own
-- version; a build below it refuses to start, saying which build the schema needs.
CREATE TABLE schema_compatibility (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    oldest_reader BIGINT  NOT NULL
);
INSERT INTO schema_compatibility (id, oldest_reader) VALUES (1, 16);
