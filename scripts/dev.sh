#!/usr/bin/env bash
# Set up, build the base template (cached), then run the all-in-one dev stack in the foreground.
# Arguments go to `podbay up` (for example --detach).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/podbay template build base
exec .venv/bin/podbay up "$@"
