#!/usr/bin/env bash
# scripts/test.sh [PYTEST ARGS...] - install what is missing (scripts/install.sh), check
# tierfs/ with ruff and mypy (settings: [tool.ruff], [tool.mypy] in pyproject.toml), then
# run the test suite with the project's .venv. Default args: -q -p no:cacheprovider
# --durations=30 tests (the 30 slowest are printed: where CI time goes)
# Tests start their own throw-away Ceph RGW (tests/conftest.py fixture `rgw`); nothing
# needs to be running beforehand. Exit code: pytest's, except "no tests collected" (5) -> 1;
# a failed check turns a 0 into 1 (pytest still runs, so one run reports both).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

bash scripts/install.sh

failed_checks=()
echo "test: .venv/bin/ruff check tierfs"
.venv/bin/ruff check tierfs || failed_checks+=("ruff check tierfs")
echo "test: .venv/bin/mypy tierfs"
.venv/bin/mypy tierfs || failed_checks+=("mypy tierfs")

[ "$#" -gt 0 ] || set -- -q -p no:cacheprovider --durations=30 tests
echo "test: .venv/bin/python -m pytest $*"
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
if [ "$rc" = 5 ]; then
  echo "test: error: pytest collected no tests (exit 5) - treated as a failure" >&2
  rc=1
fi
for check in "${failed_checks[@]}"; do
  echo "test: error: $check failed (its output is above pytest's)" >&2
  [ "$rc" != 0 ] || rc=1
done
exit "$rc"
