#!/bin/bash
# The README's test command: install the test dependencies and the package
# (which builds its native libraries), then run the tests under each Keras
# backend. BACKENDS="jax" narrows it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements-test.txt
python -m pip install -q --no-build-isolation -e .
status=0
for backend in ${BACKENDS:-tensorflow jax torch}; do
  echo "== KERAS_BACKEND=$backend"
  KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider tests "$@" || status=1
done
exit $status
