#!/usr/bin/env bash
# scripts/test.sh [PYTEST ARGS...] - install what is missing (scripts/install.sh), then run
# the test suite with the project's .venv. Default args: -q -p no:cacheprovider tests
# Tests start their own throw-away Ceph RGW (tests/conftest.py fixture `rgw`); nothing
# needs to be running beforehand. Exit code: pytest's, except "no tests collected" (5) -> 1.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

bash scripts/install.sh

[ "$#" -gt 0 ] || set -- -q -p no:cacheprovider tests
echo "test: .venv/bin/python -m pytest $*"
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
if [ "$rc" = 5 ]; then
  echo "test: error: pytest collected no tests (exit 5) - treated as a failure" >&2
  exit 1
fi
exit "$rc"
