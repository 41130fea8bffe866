-- E2B's filesystem-only auto-pause (create with autoPause and autoPauseMemory: false; the SDK's
-- on_timeout={"action": "pause", "mode": "filesystem"}): when the lease runs out, the node takes a disk snapshot
-- of the running guest, records it as cold_resume_snapshot and pauses it, so the next connect boots the sandbox
-- afresh from its files, as after an explicit pause(mode="filesystem").
ALTER TABLE e2b_sandboxes ADD COLUMN auto_pause_filesystem boolean NOT NULL DEFAULT false;
