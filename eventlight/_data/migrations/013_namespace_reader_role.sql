-- `eventlight sql` runs as a role of this namespace's own (<schema>_reader, made and granted by
-- eventlight/sql_reader.py), no longer as the cluster-wide eventlight_reader of migration 005: that
-- role was granted SELECT by every namespace's schema, so a query from one namespace could read
-- another's tables (SELECT * FROM el_other.rollouts). Take this schema's grants back from it, the
-- default privilege for later tables included; the role itself stays (other schemas of the cluster
-- may not be migrated yet) and reads nothing once they all are.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'eventlight_reader') THEN
        EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I REVOKE SELECT ON TABLES FROM eventlight_reader',
                       current_schema());
        EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM eventlight_reader', current_schema());
        EXECUTE format('REVOKE ALL ON SCHEMA %I FROM eventlight_reader', current_schema());
    END IF;
END
$$;
