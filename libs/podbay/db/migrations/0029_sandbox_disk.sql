-- A sandbox's root disk size when it was made larger than its template's at create (issue 17): MiB, NULL for
-- the template's own. The node grows the disk and its filesystem once, at create (services/nodeagent/
-- diskgrow.py); the disk file carries the size into snapshots, forks, suspend and wake, and migrations.
ALTER TABLE sandboxes ADD COLUMN disk_mib integer;
