-- Every counted write also notifies `openshell_pool_writes` (delivered when its transaction
-- commits, once per table and transaction): a replica that LISTENs reads the pool at once
-- after another replica's write instead of at its next periodic read. The count stays the
-- truth; a lost notification only costs the periodic read's delay.
CREATE OR REPLACE FUNCTION count_pool_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pool_writes (table_name, backend, writes) VALUES (TG_TABLE_NAME, pg_backend_pid(), 1)
        ON CONFLICT (table_name, backend) DO UPDATE SET writes = pool_writes.writes + 1;
    PERFORM pg_notify('openshell_pool_writes', TG_TABLE_NAME);
    RETURN NULL;
END;
$$;
