-- Promotion of snapshots to object storage, suspend and resume (docs/DESIGN.md §5, issue 4).
--
-- A snapshot's manifest (every file, its size, checksum and chunk list) is written before its upload starts
-- (promotion = 'promoting'); once every object is verified one transaction sets promotion = 'promoted'.
-- `chunks` lists the content-addressed objects in the bucket (key = sha256 of the uncompressed bytes);
-- `snapshot_chunks` says which snapshot references which chunk, so garbage collection can find the
-- unreferenced ones.
ALTER TABLE snapshots ADD COLUMN promotion text NOT NULL DEFAULT 'local'
    CHECK (promotion IN ('local', 'promoting', 'promoted', 'failed'));
ALTER TABLE snapshots ADD COLUMN manifest jsonb;
ALTER TABLE snapshots ADD COLUMN promoted_at timestamptz;
ALTER TABLE snapshots ADD COLUMN promotion_error text;
ALTER TABLE snapshots ADD COLUMN uploaded_bytes bigint;
ALTER TABLE snapshots ADD COLUMN stored_bytes bigint;
CREATE INDEX snapshots_promoting ON snapshots (node_id) WHERE promotion = 'promoting';

CREATE TABLE chunks (
    hash         text PRIMARY KEY,             -- sha256 hex of the uncompressed bytes
    size         integer NOT NULL,             -- uncompressed bytes
    stored_size  integer NOT NULL,             -- bytes in the bucket (compressed)
    created_at   timestamptz NOT NULL DEFAULT now(),
    last_ref_at  timestamptz NOT NULL DEFAULT now()  -- last time a manifest referenced it (GC grace)
);

CREATE TABLE snapshot_chunks (
    snapshot_id  text NOT NULL REFERENCES snapshots(id),
    hash         text NOT NULL,
    PRIMARY KEY (snapshot_id, hash)
);
CREATE INDEX snapshot_chunks_hash ON snapshot_chunks (hash);

-- Sandboxes carry the snapshot they were suspended to, which a resume restores.
ALTER TABLE sandboxes ADD COLUMN suspended_snapshot_id text REFERENCES snapshots(id);
