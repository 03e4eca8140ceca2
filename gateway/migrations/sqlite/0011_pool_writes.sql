-- Writes to each table the pool view reads in full: a replica re-reads a table only when its
-- count moved (and every few seconds as a safety net). Counted by triggers inside the writing
-- transaction (SQLite has one writer at a time: one row per table, backend 0). A reader takes
-- the counts before it reads the tables: an equal count later means nothing was committed to
-- that table in between.
CREATE TABLE pool_writes (
    table_name TEXT    NOT NULL,
    backend    INTEGER NOT NULL,
    writes     INTEGER NOT NULL,
    PRIMARY KEY (table_name, backend)
);
INSERT INTO pool_writes (table_name, backend, writes) VALUES
    ('instances', 0, 0), ('assignments', 0, 0), ('instance_reports', 0, 0), ('operations', 0, 0);

CREATE TRIGGER instances_writes_insert AFTER INSERT ON instances
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'instances' AND backend = 0; END;

CREATE TRIGGER instances_writes_update AFTER UPDATE ON instances
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'instances' AND backend = 0; END;

CREATE TRIGGER instances_writes_delete AFTER DELETE ON instances
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'instances' AND backend = 0; END;

CREATE TRIGGER assignments_writes_insert AFTER INSERT ON assignments
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'assignments' AND backend = 0; END;

CREATE TRIGGER assignments_writes_update AFTER UPDATE ON assignments
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'assignments' AND backend = 0; END;

CREATE TRIGGER assignments_writes_delete AFTER DELETE ON assignments
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'assignments' AND backend = 0; END;

CREATE TRIGGER instance_reports_writes_insert AFTER INSERT ON instance_reports
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'instance_reports' AND backend = 0; END;

CREATE TRIGGER instance_reports_writes_update AFTER UPDATE ON instance_reports
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'instance_reports' AND backend = 0; END;

CREATE TRIGGER instance_reports_writes_delete AFTER DELETE ON instance_reports
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'instance_reports' AND backend = 0; END;

CREATE TRIGGER operations_writes_insert AFTER INSERT ON operations
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'operations' AND backend = 0; END;

CREATE TRIGGER operations_writes_update AFTER UPDATE ON operations
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'operations' AND backend = 0; END;

CREATE TRIGGER operations_writes_delete AFTER DELETE ON operations
    BEGIN UPDATE pool_writes SET writes = writes + 1 WHERE table_name = 'operations' AND backend = 0; END;
