"""Schedules: sandboxes that wake on a cron expression or at one time (routes, time logic, the firer, a run)."""
