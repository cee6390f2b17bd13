"""Build hooks of keras-autovm: compile the native libraries into the package.

Metadata lives in pyproject.toml / setup.cfg; this file only adds the compile
step (keras_autovm/native/build.py) to `build_py`, so that

    pip install --no-build-isolation .      # into build/lib/keras_autovm/native/
    pip install --no-build-isolation -e .   # into keras_autovm/native/ (in place)

compile `_autovm_ops.so` against the TensorFlow installed in the build
environment (hence --no-build-isolation), and `_autovm_native*.so` for the
running Python. A failed pybind11 module is a warning (it is optional); a
failed TensorFlow op library is an error where TensorFlow is installed.
Set KERAS_AUTOVM_SKIP_BUILD=1 to skip both (e.g. to make an sdist).
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _load_build_module():
    # By path: the package itself may not be importable while it is built.
    spec = importlib.util.spec_from_file_location(
        "_keras_autovm_build", ROOT / "keras_autovm" / "native" / "build.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithNative(build_py):
    """`build_py`, then the native libraries into the package directory."""

    def run(self):
        super().run()
        if os.environ.get("KERAS_AUTOVM_SKIP_BUILD"):
            self.announce("KERAS_AUTOVM_SKIP_BUILD set: not compiling", level=2)
            return
        if getattr(self, "editable_mode", False):
            out_dir = ROOT / "keras_autovm" / "native"  # Editable: in place.
        else:
            out_dir = Path(self.build_lib) / "keras_autovm" / "native"
        build = _load_build_module()
        try:
            results = build.build_all(out_dir=out_dir, sources=ROOT / "ops")
        except build.BuildError as e:
            raise SystemExit(f"keras-autovm: building the TensorFlow op library failed:\n{e}")
        for name, result in results.items():
            self.announce(f"keras-autovm {name}: {result}", level=2)


class BinaryDistribution(Distribution):
    """The wheel holds compiled libraries: tag it for this platform/Python."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithNative}, distclass=BinaryDistribution)
