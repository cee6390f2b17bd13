#!/bin/bash
# Builds keras-autovm's native libraries into keras_autovm/native/ with the
# Python on PATH (its TensorFlow and pybind11): the op library _autovm_ops.so
# and the helper module _autovm_native*.so. Same as
# `python -m keras_autovm.native.build`,
# without importing the package. Options: --only tf|native, --force, --verbose,
# --out DIR.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
exec "${PYTHON:-python3}" "$root/keras_autovm/native/build.py" "$@"
