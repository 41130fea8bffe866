-- Warm slots taken out of service on purpose (above target after a pool shrank, or built from a template
-- that changed) end 'retired' rather than 'failed', so a pool's "failing" count means failures only.
ALTER TABLE warm_slots DROP CONSTRAINT warm_slots_state_check;
ALTER TABLE warm_slots ADD CONSTRAINT warm_slots_state_check
    CHECK (state IN ('preparing', 'ready', 'claimed', 'failed', 'retired'));
