-- 0030: the failover guard of every claim insert reads the server's identity once per session (see schema.sql:
-- keyed_failover_holding), not at every claim.

CREATE OR REPLACE FUNCTION keyed_failover_holding() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_server text := current_setting('keyed.server', true);
BEGIN
    IF v_server IS NULL OR v_server = '' THEN
        IF pg_is_in_recovery() THEN
            RETURN true;
        END IF;
        v_server := (SELECT c.system_identifier FROM pg_control_system() c) || '/' || keyed_ledger_timeline();
        PERFORM set_config('keyed.server', v_server, false);
    END IF;
    RETURN EXISTS (SELECT 1 FROM keyed_ledger_identity i
                    WHERE i.hold_until > now() OR i.system_identifier || '/' || i.timeline <> v_server);
END
$$;
