-- E2B protocol (docs/e2b.md): what E2B's create call asks for beyond podbay's own columns, and a short
-- history of each sandbox's metrics samples, answered by range (GET /e2b/sandboxes/{id}/metrics?start&end).
ALTER TABLE e2b_sandboxes ADD COLUMN auto_resume boolean NOT NULL DEFAULT false;

CREATE TABLE e2b_metrics (
    sandbox_id  text NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    at          timestamptz NOT NULL,
    sample      jsonb NOT NULL,
    PRIMARY KEY (sandbox_id, at)
);
