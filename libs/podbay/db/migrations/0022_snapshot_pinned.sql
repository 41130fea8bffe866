-- A pinned snapshot outlives its sandbox (docs/ARCHITECTURE.md "Snapshots"; E2B's create_snapshot, docs/e2b.md):
-- retention never reclaims it, and deleting its sandbox removes only its local files when it is promoted, so
-- it stays ready and restorable from object storage (and its chunks stay referenced) until it is deleted itself.
ALTER TABLE snapshots ADD COLUMN pinned boolean NOT NULL DEFAULT false;
