#!/usr/bin/env bash
# Set up, lint (ruff) and type-check (mypy; both configured in pyproject.toml), build the base template
# (cached; skipped when PODBAY_SKIP_E2E=1, since only e2e tests use it), then run the whole test suite.
# Arguments go to pytest.
# Collecting no tests is a failure; so is a lint or type finding, reported after the tests have run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
lint=0
.venv/bin/ruff check --quiet . || lint=$?
types=0
.venv/bin/mypy || types=$?
if [ "${PODBAY_SKIP_E2E:-}" != "1" ]; then
  .venv/bin/podbay template build base
fi
set +e
# --durations: the slowest tests are listed at the end, so a run that nears its time budget shows where it went.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; treating that as a failure" >&2
fi
if [ "$lint" -ne 0 ]; then
  echo "test.sh: ruff check found problems (listed before the tests); run: .venv/bin/ruff check ." >&2
  [ "$rc" -ne 0 ] || rc=1
fi
if [ "$types" -ne 0 ]; then
  echo "test.sh: mypy found problems (listed before the tests); run: .venv/bin/mypy" >&2
  [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
