-- Volume snapshots promoted to object storage through the snapshots' chunk store (libs/podbay/volume_promotion.py,
-- docs/ARCHITECTURE.md "Volumes"). A volume's own snapshots: a sandbox's rollback does not touch them.
-- volumes.snapshot_id: the newest promoted snapshot (what a node without the volume's file fetches);
-- snapshot_at: when its copy was taken. origin: for a fork child's volume, the file (relative to the node's
-- store) its own file is reflinked from on first attach. owner_sandbox_id: a fork child's read-only view,
-- removed with that sandbox. State 'view': such a view (not listed, not named by the tenant).

CREATE TABLE volume_snapshots (
    id              text PRIMARY KEY,                 -- vsnap_...
    volume_id       text NOT NULL REFERENCES volumes(id) ON DELETE CASCADE,
    node_id         text NOT NULL,
    reason          text NOT NULL,                    -- cadence | suspend
    state           text NOT NULL CHECK (state IN ('promoting', 'promoted', 'failed')),
    manifest        jsonb,
    total_bytes     bigint,
    uploaded_bytes  bigint,
    stored_bytes    bigint,
    error           text,
    taken_at        timestamptz NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    promoted_at     timestamptz
);
CREATE INDEX volume_snapshots_volume ON volume_snapshots (volume_id, taken_at DESC);

-- The chunks a volume snapshot references; garbage collection keeps them.
CREATE TABLE volume_snapshot_chunks (
    snapshot_id  text NOT NULL REFERENCES volume_snapshots(id) ON DELETE CASCADE,
    hash         text NOT NULL,
    PRIMARY KEY (snapshot_id, hash)
);
CREATE INDEX volume_snapshot_chunks_hash ON volume_snapshot_chunks (hash);

ALTER TABLE volumes ADD COLUMN snapshot_id text;
ALTER TABLE volumes ADD COLUMN snapshot_at timestamptz;
ALTER TABLE volumes ADD COLUMN origin text;
ALTER TABLE volumes ADD COLUMN owner_sandbox_id text;
ALTER TABLE volumes DROP CONSTRAINT volumes_state_check;
ALTER TABLE volumes ADD CONSTRAINT volumes_state_check CHECK (state IN ('available', 'deleting', 'view'));
