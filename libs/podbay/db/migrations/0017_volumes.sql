-- Volumes (docs/ARCHITECTURE.md "Volumes"): named, tenant-scoped ext4 filesystems in files on a node's btrfs
-- store. A volume is bound to a node (node_id) by the scheduler when it places the first sandbox using it; the
-- node agent makes its file there. 'deleting': the API deleted it; the node agent removes the file, then the row.

CREATE TABLE volumes (
    id          text PRIMARY KEY,                 -- vol_...
    tenant_id   text NOT NULL REFERENCES tenants(id),
    name        text NOT NULL,
    size_bytes  bigint NOT NULL CHECK (size_bytes > 0),
    node_id     text,                             -- where its file lives; NULL until first attached
    state       text NOT NULL DEFAULT 'available' CHECK (state IN ('available', 'deleting')),
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX volumes_tenant_name ON volumes (tenant_id, name) WHERE state = 'available';

-- One row per volume a sandbox has at a path (slot = the guest's volume slot, 0..3). Rows of a deleted
-- sandbox no longer count as attachments; they stay as its history.
CREATE TABLE sandbox_volumes (
    sandbox_id  text NOT NULL REFERENCES sandboxes(id),
    volume_id   text NOT NULL REFERENCES volumes(id) ON DELETE CASCADE,
    slot        integer NOT NULL CHECK (slot >= 0),
    path        text NOT NULL,
    readonly    boolean NOT NULL,
    PRIMARY KEY (sandbox_id, slot),
    UNIQUE (sandbox_id, path)
);
CREATE INDEX sandbox_volumes_volume ON sandbox_volumes (volume_id);
