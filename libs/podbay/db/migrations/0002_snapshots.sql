-- Snapshots of sandboxes (docs/DESIGN.md §5). Node-local for now: node_id names where the files are.
CREATE TABLE snapshots (
    id           text PRIMARY KEY,
    tenant_id    text NOT NULL REFERENCES tenants(id),
    sandbox_id   text NOT NULL REFERENCES sandboxes(id),
    node_id      text REFERENCES nodes(id),
    kind         text NOT NULL CHECK (kind IN ('disk', 'full')),
    state        text NOT NULL CHECK (state IN ('creating', 'ready', 'failed', 'deleted')),
    parent_id    text REFERENCES snapshots(id),
    generation   bigint NOT NULL,
    size_bytes   bigint,
    paused_ms    double precision,
    error        text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    ready_at     timestamptz
);
CREATE INDEX snapshots_sandbox ON snapshots (sandbox_id, created_at DESC);

ALTER TABLE sandboxes ADD COLUMN parent_sandbox_id text REFERENCES sandboxes(id);
ALTER TABLE sandboxes ADD COLUMN source_snapshot_id text REFERENCES snapshots(id);
