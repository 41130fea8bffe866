-- Shared rate limits (podbay.ratelimit, used by the API's port edge for public ports): one row per key and
-- window of PostgreSQL's clock, counting the admissions every API replica reserved in it. UNLOGGED: a hot
-- counter of short-lived rows needs no WAL, and losing it in a crash only forgets windows of a few seconds.
-- `granted` is what the latest reservation got (read back by its RETURNING). Rows of windows that ended over
-- a minute ago are deleted by the limiters.
CREATE UNLOGGED TABLE rate_windows (
    key           text NOT NULL,
    window_start  bigint NOT NULL,  -- seconds since the epoch, a multiple of the window's length
    ends_at       bigint NOT NULL,  -- window_start plus the window's length
    used          integer NOT NULL,
    granted       integer NOT NULL,
    PRIMARY KEY (key, window_start)
);
