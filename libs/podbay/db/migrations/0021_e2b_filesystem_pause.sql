-- E2B's filesystem-only pause (docs/e2b.md): the disk snapshot taken at the pause; the next connect boots the
-- sandbox afresh from it (a podbay restore of a disk snapshot) instead of resuming its memory.
ALTER TABLE e2b_sandboxes ADD COLUMN cold_resume_snapshot text;
