#!/usr/bin/env bash
# The whole test suite, on a fresh machine or this one: what the README's test command and CI's
# .ci/run both call. Set-up (idempotent): Debian packages the suite needs when missing (npm, to
# fetch Node 22 and the conformance suite; chromium, for the console's browser test, driven by
# Playwright's Python package: no browser download; redis-server and haproxy, which the Redis-store
# and replica tests start on loopback ports of their own; prometheus, whose promtool tests the alert
# rules and whose server checks the dashboard's queries against a scraped proxy), a virtual environment with the project and
# its test extra; then the static checks (`mypy proxy`, `ruff check`, `ruff format --check`, and
# `lint-imports` for the package layers), then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
command -v mount >/dev/null 2>&1 || missing+=(mount)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "scripts/test.sh: please install: ${missing[*]}" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[test]'
.venv/bin/mypy proxy
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
