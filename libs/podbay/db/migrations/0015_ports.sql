-- Guest ports reached through the API's edge (services/api/routes/ports*.py): a port is private unless a row here
-- marks it public. Every change is also an audit row (sandbox.port.public / sandbox.port.private).
CREATE TABLE sandbox_ports (
    sandbox_id  text NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    port        integer NOT NULL CHECK (port BETWEEN 1 AND 65535),
    public      boolean NOT NULL DEFAULT false,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sandbox_id, port)
);

-- E2B's create option network.allowPublicTraffic (its default: true): ports open without E2B's traffic token
-- through E2B's hosts. false here, so a sandbox that did not come through E2B's create is never opened by it.
ALTER TABLE e2b_sandboxes ADD COLUMN allow_public_traffic boolean NOT NULL DEFAULT false;
