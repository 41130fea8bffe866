-- E2B's template build request (POST /v3/templates) names the template's resources (cpuCount, memoryMB);
-- they are kept with the request until its start (POST /v2/templates/{id}/builds/{build}) builds with them.
-- NULL: not given (the FROM template's).
ALTER TABLE e2b_template_builds ADD COLUMN cpu_count integer, ADD COLUMN memory_mb integer;
