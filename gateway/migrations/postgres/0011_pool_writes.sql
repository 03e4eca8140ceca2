-- Writes to each table the pool view reads in full, counted per table and per database
-- connection: a replica re-reads a table only when its sum moved (and every few seconds as a
-- safety net). Statement triggers count inside the writing transaction, so a sum includes a
-- write exactly when its rows are committed; one row per connection, so concurrent writers
-- never wait for each other on the count. A reader takes the sums before it reads the tables:
-- an equal sum later means nothing was committed to that table in between.
CREATE TABLE pool_writes (
    table_name TEXT   NOT NULL,
    backend    BIGINT NOT NULL,
    writes     BIGINT NOT NULL,
    PRIMARY KEY (table_name, backend)
);

CREATE FUNCTION count_pool_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pool_writes (table_name, backend, writes) VALUES (TG_TABLE_NAME, pg_backend_pid(), 1)
        ON CONFLICT (table_name, backend) DO UPDATE SET writes = pool_writes.writes + 1;
    RETURN NULL;
END;
$$;

CREATE TRIGGER instances_writes AFTER INSERT OR UPDATE OR DELETE ON instances
    FOR EACH STATEMENT EXECUTE FUNCTION count_pool_write();
CREATE TRIGGER assignments_writes AFTER INSERT OR UPDATE OR DELETE ON assignments
    FOR EACH STATEMENT EXECUTE FUNCTION count_pool_write();
CREATE TRIGGER instance_reports_writes AFTER INSERT OR UPDATE OR DELETE ON instance_reports
    FOR EACH STATEMENT EXECUTE FUNCTION count_pool_write();
CREATE TRIGGER operations_writes AFTER INSERT OR UPDATE OR DELETE ON operations
    FOR EACH STATEMENT EXECUTE FUNCTION count_pool_write();
