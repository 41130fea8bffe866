-- E2B snapshot names (docs/e2b.md "Snapshots and fork"): create_snapshot(name=...) names a podbay snapshot;
-- a later snapshot with the same name takes the name over, and Sandbox.create(name) starts from it.
CREATE TABLE e2b_snapshot_names (
    tenant_id    text NOT NULL REFERENCES tenants (id),
    name         text NOT NULL,
    snapshot_id  text NOT NULL REFERENCES snapshots (id) ON DELETE CASCADE,
    PRIMARY KEY (tenant_id, name)
);
