-- E2B's network.maskRequestHost: the Host header the port edge sends a sandbox's ports ("${PORT}" replaced).
ALTER TABLE e2b_sandboxes ADD COLUMN mask_request_host text;
