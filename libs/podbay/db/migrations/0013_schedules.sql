-- Schedules: a sandbox wakes on a cron expression or at one time, runs a command (or only wakes), and goes
-- back to the state it was in (services/api/schedules/, docs/ARCHITECTURE.md "Schedules").
CREATE TABLE schedules (
    id            text PRIMARY KEY,
    tenant_id     text NOT NULL REFERENCES tenants(id),
    sandbox_id    text NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    cron          text,                        -- five fields; NULL for a one-shot
    tz            text NOT NULL DEFAULT 'UTC', -- IANA zone the cron fields are read in
    at            timestamptz,                 -- the one-shot's time; NULL for a cron schedule
    command       jsonb,                       -- {argv, env, cwd, user, timeout_s}; NULL: wake only
    awake_s       integer NOT NULL DEFAULT 0,  -- stay awake this long after the command before going back
    overlap       text NOT NULL DEFAULT 'skip' CHECK (overlap IN ('skip', 'queue')),
    missed        text NOT NULL DEFAULT 'catch_up_once' CHECK (missed IN ('catch_up_once', 'skip')),
    next_fire_at  timestamptz,                 -- NULL once a one-shot has fired
    created_at    timestamptz NOT NULL DEFAULT now(),
    CHECK ((cron IS NULL) <> (at IS NULL))
);
CREATE INDEX schedules_due ON schedules (next_fire_at) WHERE next_fire_at IS NOT NULL;
CREATE INDEX schedules_sandbox ON schedules (sandbox_id);

-- One row per fire time of a schedule: the unique key is what makes a fire happen once across replicas and
-- restarts (the row is inserted in the same transaction that advances schedules.next_fire_at).
CREATE TABLE schedule_runs (
    id                 text PRIMARY KEY,
    schedule_id        text NOT NULL REFERENCES schedules(id) ON DELETE CASCADE,
    sandbox_id         text NOT NULL,
    tenant_id          text NOT NULL,
    fire_at            timestamptz NOT NULL,   -- the schedule's time
    due_at             timestamptz NOT NULL,   -- fire_at plus this fire's jitter
    state              text NOT NULL CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'timed_out',
                                              'wake_failed', 'skipped', 'interrupted')),
    reason             text,                   -- skipped: overlap | missed; failures: an error code
    message            text,
    owner              text,                   -- the API process running it
    heartbeat_at       timestamptz,            -- renewed by its owner each tick; stale = the owner died
    prior_state        text,                   -- the sandbox's state before the wake (restored after)
    created_at         timestamptz NOT NULL DEFAULT now(),
    started_at         timestamptz,
    awake_at           timestamptz,            -- the sandbox answered (wake done)
    command_started_at timestamptz,
    finished_at        timestamptz,
    exit_code          integer,
    stdout_head        text,                   -- first 64 KiB of stdout
    stdout_tail        text,                   -- last 64 KiB when longer than the head
    stderr_head        text,
    stderr_tail        text,
    stdout_bytes       bigint,
    stderr_bytes       bigint,
    output_key         text,                   -- object-store prefix of the whole output (stdout, stderr)
    UNIQUE (schedule_id, fire_at)
);
CREATE INDEX schedule_runs_open ON schedule_runs (state, due_at) WHERE state IN ('queued', 'running');
CREATE INDEX schedule_runs_schedule ON schedule_runs (schedule_id, fire_at DESC);

-- A sandbox that is being deleted has no schedules, whichever path deletes it (API, lease expiry, node loss);
-- runs go with them (ON DELETE CASCADE).
CREATE FUNCTION schedules_drop_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM schedules WHERE sandbox_id = NEW.id;
    RETURN NULL;
END $$;
CREATE TRIGGER sandboxes_drop_schedules AFTER UPDATE OF state ON sandboxes
    FOR EACH ROW WHEN (NEW.state IN ('deleting', 'deleted') AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION schedules_drop_deleted();
