-- The role `eventlight sql` runs user queries as: it may read this schema's tables and views and
-- nothing else. With the DSN's own (often superuser) role, a query could run shell commands
-- (COPY ... TO PROGRAM), read server files (pg_read_file) or end other sessions
-- (pg_terminate_backend). The role is shared by every namespace of the cluster; each schema grants
-- it SELECT on its own tables, now and later (default privileges). It cannot write, and queries get
-- a statement timeout even if the client sets none.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'eventlight_reader') THEN
        CREATE ROLE eventlight_reader LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOREPLICATION;
        ALTER ROLE eventlight_reader SET statement_timeout = '30s';
        ALTER ROLE eventlight_reader SET default_transaction_read_only = on;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;  -- another schema's migration created it at the same moment
END
$$;
DO $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO eventlight_reader', current_schema());
    EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA %I TO eventlight_reader', current_schema());
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT ON TABLES TO eventlight_reader',
                   current_schema());
END
$$;
