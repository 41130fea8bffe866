-- Leases (docs/DESIGN.md §5, issue "lease and idle policy"): a sandbox runs until its lease runs out and the
-- guest is idle; then the lease action (pause or delete) is applied, never a silent kill.
ALTER TABLE sandboxes ADD COLUMN lease_s integer NOT NULL DEFAULT 3600;
ALTER TABLE sandboxes ADD COLUMN lease_action text NOT NULL DEFAULT 'pause' CHECK (lease_action IN ('pause', 'delete'));
ALTER TABLE sandboxes ADD COLUMN lease_expires_at timestamptz;
CREATE INDEX sandboxes_lease ON sandboxes (node_id, lease_expires_at) WHERE state = 'running';
