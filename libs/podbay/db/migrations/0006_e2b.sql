-- E2B SDK compatibility (issue "Drop-in for E2B's SDK"): what E2B's create call sets beyond podbay's own
-- sandbox columns. env_vars is the default environment of every command started through envd.
CREATE TABLE e2b_sandboxes (
    sandbox_id  text PRIMARY KEY REFERENCES sandboxes (id) ON DELETE CASCADE,
    env_vars    jsonb NOT NULL DEFAULT '{}'
);
