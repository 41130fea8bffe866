#!/usr/bin/env bash
# Set up, build the base template (cached; skipped when PODBAY_SKIP_E2E=1, since only e2e tests use it),
# then run the whole test suite. Arguments go to pytest. Collecting no tests is a failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if [ "${PODBAY_SKIP_E2E:-}" != "1" ]; then
  .venv/bin/podbay template build base
fi
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; treating that as a failure" >&2
fi
exit "$rc"
