-- 0004: holder liveness (issue 9 item 8): a worker restarted on the same machine gives back, at once, the claims
-- of a predecessor whose processes are all gone, instead of waiting a whole lease for the reaper.

-- machine: the boot and process namespace the holder's pids belong to (two holders with the same machine can
-- check each other's pids); pids: the holder's main process and its pool processes, refreshed by its heartbeat.
ALTER TABLE keyed_holders ADD COLUMN machine text;
ALTER TABLE keyed_holders ADD COLUMN pids integer[];
CREATE INDEX keyed_holders_machine_idx ON keyed_holders (machine) WHERE machine IS NOT NULL;
