"""Builds keras-autovm's native libraries with the system C++ compiler.

Two libraries, built into this directory (`keras_autovm/native/`), both
loading the CUDA driver at run time, so that no CUDA toolkit or header is
needed to build them:

- `_autovm_ops.so`: the TensorFlow op library (ops/tf/, ops/common/),
  compiled against the installed TensorFlow's headers (`tf.sysconfig`). The
  TensorFlow version it was built for is written next to it in
  `_autovm_ops.tf_version`; `mechanisms/tensorflow/ops.py` warns when it differs.
- `_autovm_native<EXT_SUFFIX>`: the pybind11 helper module (ops/native/,
  ops/common/), for the running Python. Optional: the package works without
  it.

Used by setup.py (`pip install --no-build-isolation .` and `pip install -e .`)
and from the command line:

    python -m keras_autovm.native.build            # both, into keras_autovm/native/
    python -m keras_autovm.native.build --only tf --force --verbose

This file imports nothing outside the standard library at module level (setup
loads it by path, before the package is importable). A build is skipped when
the library on disk was built from the same sources with the same flags and
TensorFlow version (a hash in the stamp file next to it); `--force` rebuilds.
"""

import argparse
import concurrent.futures
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

TF_LIBRARY = "_autovm_ops.so"
TF_VERSION_FILE = "_autovm_ops.tf_version"
NATIVE_NAME = "_autovm_native"
BUILD_COMMAND = "python -m keras_autovm.native.build"

_PACKAGE_DIR = Path(__file__).resolve().parent
_DEFAULT_SOURCES = _PACKAGE_DIR.parent.parent / "ops"

_TF_SOURCES = ("tf/autovm_ops.cc", "tf/autovm_kernels.cc", "common/cuda_driver.cc")
_NATIVE_SOURCES = ("native/autovm_native.cc", "common/cuda_driver.cc")
_HEADERS = ("common/cuda_driver.h",)
_COMMON_FLAGS = ("-std=c++17", "-O2", "-fPIC")


class BuildError(RuntimeError):
    """A compile or link step failed; the message holds the command and its output."""


def native_library_name():
    """File name of the pybind11 module for the running Python."""
    return NATIVE_NAME + sysconfig.get_config_var("EXT_SUFFIX")


def _sources_dir(sources):
    path = Path(sources) if sources is not None else _DEFAULT_SOURCES
    if not (path / "tf" / "autovm_ops.cc").is_file():
        raise BuildError(
            f"keras-autovm's C++ sources were not found in {path} (expected "
            "ops/tf/autovm_ops.cc there). Build from a source checkout or sdist."
        )
    return path


def _compiler():
    return shlex.split(os.environ.get("CXX", "g++"))


def _digest(sources_dir, files, flags):
    h = hashlib.sha256()
    for name in sorted(set(files) | set(_HEADERS)):
        h.update(name.encode())
        h.update((sources_dir / name).read_bytes())
    h.update("\0".join(flags).encode())
    return h.hexdigest()[:16]


def _read_stamp(path):
    """key=value lines of a stamp file (the first line is the bare version)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out = {"version": lines[0].strip()} if lines else {}
    for line in lines[1:]:
        key, _, value = line.partition("=")
        out[key.strip()] = value.strip()
    return out


def _run(cmd, verbose):
    if verbose:
        print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            "command failed (exit %d): %s\n%s%s"
            % (proc.returncode, " ".join(shlex.quote(c) for c in cmd),
               proc.stdout, proc.stderr)
        )
    return proc


def _compile_and_link(sources_dir, files, compile_flags, link_flags, target,
                      jobs, verbose):
    """Compiles `files` in parallel, links them into `target` atomically.

    The library is written under a temporary name and renamed into place, so
    a process that has the old one loaded keeps a valid mapping.
    """
    cxx = _compiler()
    with tempfile.TemporaryDirectory(prefix="autovm-build-") as tmp:
        objects = []
        commands = []
        for i, name in enumerate(files):
            obj = os.path.join(tmp, f"{i}_{Path(name).stem}.o")
            objects.append(obj)
            commands.append(cxx + list(compile_flags)
                            + ["-c", str(sources_dir / name), "-o", obj])
        workers = max(1, min(len(commands), jobs or os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for future in [pool.submit(_run, c, verbose) for c in commands]:
                future.result()
        partial = os.path.join(tmp, target.name)
        _run(cxx + ["-shared", "-o", partial] + objects + list(link_flags), verbose)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(target.name + ".tmp%d" % os.getpid())
        shutil.copyfile(partial, staged)
        os.chmod(staged, 0o755)
        os.replace(staged, target)
    return target


def tensorflow_flags():
    """(version, compile flags, link flags) of the installed TensorFlow."""
    try:
        import tensorflow as tf  # noqa: PLC0415 -- optional, heavy
    except ImportError as e:
        raise BuildError(
            "TensorFlow is not installed in this Python (%s); the op library "
            "is built against its headers." % sys.executable
        ) from e
    return (tf.__version__, list(tf.sysconfig.get_compile_flags()),
            list(tf.sysconfig.get_link_flags()))


def build_tf_ops(out_dir=None, sources=None, force=False, jobs=None,
                 verbose=False):
    """Builds `_autovm_ops.so` into `out_dir` for the installed TensorFlow.

    Args:
        out_dir: Where the library goes. Defaults to keras_autovm/native/.
        sources: The `ops/` directory. Defaults to the one of this checkout.
        force: Rebuild even when the stamp says the library is current.
            Defaults to `False`.
        jobs: Parallel compiles. Defaults to the number of CPUs.
        verbose: Print the commands. Defaults to `False`.

    Returns:
        The path of the library.

    Raises:
        BuildError: TensorFlow is missing, or the compiler failed.
    """
    sources_dir = _sources_dir(sources)
    out = Path(out_dir) if out_dir is not None else _PACKAGE_DIR
    version, tf_cflags, tf_lflags = tensorflow_flags()
    cflags = list(_COMMON_FLAGS) + ["-DGOOGLE_CUDA=1",
                                    "-Wno-deprecated-declarations"] + tf_cflags
    lflags = tf_lflags + ["-ldl"]
    digest = _digest(sources_dir, _TF_SOURCES, cflags + lflags + [version])
    target = out / TF_LIBRARY
    stamp = out / TF_VERSION_FILE
    if (not force and target.is_file()
            and _read_stamp(stamp).get("sources") == digest):
        return target
    _compile_and_link(sources_dir, _TF_SOURCES, cflags, lflags, target, jobs,
                      verbose)
    stamp.write_text(
        f"{version}\nsources={digest}\ncompiler={' '.join(_compiler())}\n"
    )
    return target


def build_native(out_dir=None, sources=None, force=False, jobs=None,
                 verbose=False):
    """Builds the pybind11 module `_autovm_native` for the running Python.

    Args: as `build_tf_ops`.

    Returns:
        The path of the module.

    Raises:
        BuildError: pybind11 is missing, or the compiler failed.
    """
    sources_dir = _sources_dir(sources)
    out = Path(out_dir) if out_dir is not None else _PACKAGE_DIR
    try:
        import pybind11  # noqa: PLC0415 -- build-time only
    except ImportError as e:
        raise BuildError("pybind11 is not installed in this Python") from e
    cflags = list(_COMMON_FLAGS) + [
        "-fvisibility=hidden",
        "-I" + sysconfig.get_paths()["include"],
        "-I" + pybind11.get_include(),
    ]
    lflags = ["-ldl"]
    name = native_library_name()
    digest = _digest(sources_dir, _NATIVE_SOURCES,
                     cflags + lflags + [name, pybind11.__version__])
    target = out / name
    stamp = out / (NATIVE_NAME + ".stamp")
    if (not force and target.is_file()
            and _read_stamp(stamp).get("sources") == digest):
        return target
    _compile_and_link(sources_dir, _NATIVE_SOURCES, cflags, lflags, target,
                      jobs, verbose)
    stamp.write_text(f"{pybind11.__version__}\nsources={digest}\n")
    return target


def build_all(out_dir=None, sources=None, force=False, jobs=None,
              verbose=False, require_tensorflow=False):
    """Builds both libraries as an install does.

    The TensorFlow op library is required where TensorFlow is installed (a
    compile failure raises); without TensorFlow it is skipped with a warning,
    as it could not be used anyway. The pybind11 module is optional: a failure
    is a warning.

    Returns:
        dict name -> path, or the reason it was not built.
    """
    results = {}
    try:
        import tensorflow  # noqa: F401, PLC0415
        have_tf = True
    except ImportError:
        have_tf = False
    if have_tf or require_tensorflow:
        results["tf_ops"] = build_tf_ops(out_dir, sources, force, jobs, verbose)
    else:
        results["tf_ops"] = "skipped: TensorFlow is not installed"
        warnings.warn(
            "keras-autovm: TensorFlow is not installed, so its op library was "
            f"not built; install TensorFlow, then run `{BUILD_COMMAND}`.",
            stacklevel=2,
        )
    try:
        results["native"] = build_native(out_dir, sources, force, jobs, verbose)
    except BuildError as e:
        results["native"] = "failed: %s" % e
        warnings.warn(
            "keras-autovm: the optional native helper (pybind11) did not "
            "build; the package works without it (keras_autovm.native.helper "
            "is None). Reason:\n%s" % e,
            stacklevel=2,
        )
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog=BUILD_COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None,
                        help="output directory (default: keras_autovm/native/)")
    parser.add_argument("--sources", default=None,
                        help="the ops/ directory (default: the checkout's)")
    parser.add_argument("--only", choices=("tf", "native"), default=None)
    parser.add_argument("--force", action="store_true",
                        help="rebuild even when up to date")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)
    common = dict(out_dir=args.out, sources=args.sources, force=args.force,
                  jobs=args.jobs, verbose=args.verbose)
    try:
        if args.only == "tf":
            results = {"tf_ops": build_tf_ops(**common)}
        elif args.only == "native":
            results = {"native": build_native(**common)}
        else:
            results = build_all(**common)
    except BuildError as e:
        print(f"keras-autovm build failed: {e}", file=sys.stderr)
        return 1
    for name, result in results.items():
        print(f"{name}: {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
