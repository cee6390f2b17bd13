"""The pybind11 helper (ops/native/, keras_autovm/native/) without a GPU.

The module is built first if absent. On a machine without a CUDA driver it
must import, report `available() is False`, and make every function raise a
RuntimeError that says there is no driver. The GPU side is checked by
recipes/gpu_managed_ops.py.
"""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from keras_autovm.native import build as native_build

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nat():
    native_build.build_native()
    import keras_autovm.native as module  # noqa: PLC0415 -- after the build

    module = importlib.reload(module)  # In case it was imported before the build.
    assert module.helper is not None, module._IMPORT_ERROR
    return module


def _has_driver(nat):
    return nat.helper.driver_available()


def test_module_imports(nat):
    assert nat.helper.__name__ == "keras_autovm.native._autovm_native"
    info = nat.helper.driver_info()
    assert set(info) == {"available", "error", "version", "prefetch_entry",
                         "advise_entry"}
    assert nat.available() is info["available"]


def test_not_available_without_driver(nat):
    if _has_driver(nat):
        pytest.skip("a CUDA driver is present on this machine")
    assert nat.available() is False
    info = nat.helper.driver_info()
    assert info["available"] is False
    assert "libcuda.so.1" in info["error"] or "cuInit" in info["error"]


@pytest.mark.parametrize("call", [
    lambda n: n.device_count(),
    lambda n: n.device_info(0),
    lambda n: n.mem_info(),
    lambda n: n.mem_info(device=0),
    lambda n: n.pointer_info(0x1000),
    lambda n: n.pointer_info(0x1000, nbytes=4096),
    lambda n: n.prefetch(0x1000, 4096, to="host"),
    lambda n: n.prefetch(0x1000, 4096, to=0, sync=False),
    lambda n: n.advise(0x1000, 4096, "set_preferred_location", "host"),
    lambda n: n.synchronize(),
    lambda n: n.link_probe(),
    lambda n: n.link_probe(nbytes=1 << 20, repeats=1, device=0),
], ids=["device_count", "device_info", "mem_info", "mem_info_kw", "pointer_info",
        "pointer_info_n", "prefetch_host", "prefetch_dev", "advise", "synchronize",
        "link_probe", "link_probe_small"])
def test_functions_raise_without_driver(nat, call):
    if _has_driver(nat):
        pytest.skip("a CUDA driver is present on this machine")
    with pytest.raises(RuntimeError, match="^no CUDA driver: "):
        call(nat.helper)


def test_argument_errors_before_the_driver(nat):
    with pytest.raises(ValueError, match="nbytes must be at least 1 MiB"):
        nat.helper.link_probe(nbytes=1024)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        nat.helper.link_probe(repeats=0)
    with pytest.raises(TypeError):
        nat.helper.mem_info("zero")


def test_native_is_none_when_the_module_is_missing(nat, monkeypatch):
    # As if never built: no submodule, and importing it fails.
    monkeypatch.delattr(nat, "_autovm_native", raising=False)
    monkeypatch.setitem(sys.modules, "keras_autovm.native._autovm_native", None)
    try:
        module = importlib.reload(nat)
        assert module.helper is None
        assert module.available() is False
        with pytest.raises(ImportError, match="python -m keras_autovm.native.build --only native"):
            module.require()
    finally:
        monkeypatch.undo()
        importlib.reload(nat)
    assert nat.helper is not None


@pytest.mark.skipif(os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow",
                    reason="the build does not depend on the Keras backend; "
                    "it runs once, under the TensorFlow backend")
def test_build_native_from_a_fresh_copy(tmp_path):
    shutil.copytree(ROOT / "ops", tmp_path / "ops")
    shutil.copy(ROOT / "keras_autovm" / "native" / "build.py", tmp_path / "build.py")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "build.py"), "--out", str(out),
         "--sources", str(tmp_path / "ops"), "--only", "native"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    built = out / native_build.native_library_name()
    assert built.is_file()
    proc = subprocess.run(
        [sys.executable, "-c",
         "import _autovm_native as n; print('OK', n.driver_available())"],
        capture_output=True, text=True, cwd=out, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK ")


def test_build_failure_of_the_native_module_is_a_warning(tmp_path, monkeypatch):
    # A compiler that always fails: build_all warns for the optional module.
    shutil.copytree(ROOT / "ops", tmp_path / "ops")
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(native_build, "build_tf_ops", lambda *args, **kwargs: "stub")
    with pytest.warns(UserWarning, match="optional native helper"):
        results = native_build.build_all(out_dir=tmp_path / "out",
                                   sources=tmp_path / "ops")
    assert results == {"tf_ops": "stub", "native": results["native"]}
    assert results["native"].startswith("failed: command failed")


# A stand-in libcuda.so.1 (plain C, host memory) that lets the driver-facing
# code run on a machine without a GPU: entry point resolution (both the CUDA
# 12.2+/13 location-struct forms and the older int-device forms), the safety
# cap of the link probe, freeing on every path, and error messages naming the
# call and the CUresult. MOCK_FAIL=<symbol> makes that call fail with
# CUDA_ERROR_OUT_OF_MEMORY; MOCK_FREE_MIB sets the free memory it reports.
MOCK_LIBCUDA = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { int type; int id; } CUmemLocation;
static int live[4];  /* device, host, managed, events */
static int managed_allocs, prefetches, fail_count;
static char *m_ptr[256]; static size_t m_size[256]; static int m_n;
static int m_type[256], m_id[256];  /* last prefetch location per buffer */
static CUresult fails(const char *name) {
  const char *f = getenv("MOCK_FAIL");
  if (f && strcmp(f, name) == 0) { ++fail_count; return 2; }
  return 0;
}
#define F(name) { CUresult r_ = fails(#name); if (r_) return r_; }
void mock_state(int *out) {
  out[0] = live[0]; out[1] = live[1]; out[2] = live[2]; out[3] = live[3];
  out[4] = managed_allocs; out[5] = prefetches; out[6] = fail_count;
}
CUresult cuInit(unsigned f) { (void)f; F(cuInit); return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuGetErrorName(CUresult r, const char **s) {
  *s = r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : r == 1 ? "CUDA_ERROR_INVALID_VALUE"
                                          : "CUDA_ERROR_UNKNOWN";
  return 0;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
  *s = r == 2 ? "out of memory" : "mock error"; return 0;
}
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *d, int i) { *d = i; return 0; }
CUresult cuDeviceGetName(char *s, int n, int d) { (void)d; snprintf(s, n, "Mock GPU"); return 0; }
CUresult cuDeviceGetAttribute(int *v, int a, int d) { (void)a; (void)d; *v = 1; return 0; }
static int ctx_storage;
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = &ctx_storage; return 0; }
CUresult cuCtxPushCurrent_v2(void *c) { (void)c; return 0; }
CUresult cuCtxPopCurrent_v2(void **c) { *c = &ctx_storage; return 0; }
CUresult cuCtxGetDevice(int *d) { *d = 0; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuStreamGetCtx(void *s, void **c) { (void)s; *c = &ctx_storage; return 0; }
static int stream_storage[8]; static int n_streams;
CUresult cuStreamCreate(void **s, unsigned f) { (void)f; *s = &stream_storage[n_streams++ % 8]; return 0; }
CUresult cuStreamSynchronize(void *s) { (void)s; return 0; }
CUresult cuStreamWaitEvent(void *s, void *e, unsigned f) { (void)s; (void)e; (void)f; return 0; }
CUresult cuEventCreate(void **e, unsigned f) { (void)f; F(cuEventCreate); *e = malloc(8); ++live[3]; return 0; }
CUresult cuEventRecord(void *e, void *s) { (void)e; (void)s; return 0; }
CUresult cuEventSynchronize(void *e) { (void)e; return 0; }
CUresult cuEventElapsedTime(float *ms, void *a, void *b) { (void)a; (void)b; *ms = 1.0f; return 0; }
CUresult cuEventDestroy_v2(void *e) { free(e); --live[3]; return 0; }
CUresult cuMemGetInfo_v2(size_t *fr, size_t *total) {
  const char *f = getenv("MOCK_FREE_MIB");
  *fr = (size_t)(f ? atoi(f) : 64) << 20; *total = (size_t)1 << 34; return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { F(cuMemAlloc_v2); *p = (CUdeviceptr)malloc(n); ++live[0]; return 0; }
CUresult cuMemFree_v2(CUdeviceptr p) {
  for (int i = 0; i < m_n; ++i) if ((CUdeviceptr)m_ptr[i] == p) { m_ptr[i] = 0; --live[2]; free((void *)p); return 0; }
  free((void *)p); --live[0]; return 0;
}
CUresult cuMemAllocHost_v2(void **p, size_t n) { F(cuMemAllocHost_v2); *p = malloc(n); ++live[1]; return 0; }
CUresult cuMemFreeHost(void *p) { free(p); --live[1]; return 0; }
CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned f) {
  (void)f; F(cuMemAllocManaged);
  m_ptr[m_n] = malloc(n); m_size[m_n] = n; m_type[m_n] = 0; m_id[m_n] = -2;
  *p = (CUdeviceptr)m_ptr[m_n++];
  ++live[2]; ++managed_allocs; return 0;
}
CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) { memset((void *)p, v, n); return 0; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s) { (void)s; memcpy((void *)d, h, n); return 0; }
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s) { (void)s; memcpy(h, (void *)d, n); return 0; }
static int find(CUdeviceptr p) {
  for (int i = 0; i < m_n; ++i)
    if (m_ptr[i] && p >= (CUdeviceptr)m_ptr[i] && p < (CUdeviceptr)m_ptr[i] + m_size[i]) return i;
  return -1;
}
static int is_managed(CUdeviceptr p) { return find(p) >= 0; }
CUresult cuPointerGetAttribute(void *out, int attr, CUdeviceptr p) {
  if (!is_managed(p)) return 1;  /* unknown to the driver */
  if (attr == 8) *(unsigned *)out = 1;
  else if (attr == 2) *(unsigned *)out = 2;
  else if (attr == 9) *(int *)out = 0;
  else return 1;
  return 0;
}
CUresult cuMemRangeGetAttribute(void *out, size_t n, int attr, CUdeviceptr p, size_t c) {
  (void)n; (void)c;
  int i = find(p);
  if (i < 0) return 1;
#ifdef MOCK_V1
  if (attr == 4) { *(int *)out = m_id[i]; return 0; }
  return 1;  /* CUDA < 12.2: no _TYPE/_ID attributes */
#else
  if (attr == 7) { *(int *)out = m_type[i]; return 0; }
  if (attr == 8) { *(int *)out = m_id[i]; return 0; }
  return 1;
#endif
}
#ifdef MOCK_V1
CUresult cuMemPrefetchAsync(CUdeviceptr p, size_t n, int dev, void *s) {
  (void)n; (void)s; F(cuMemPrefetchAsync); ++prefetches;
  int i = find(p); if (i < 0) return 1;
  m_id[i] = dev; return 0;
}
CUresult cuMemAdvise(CUdeviceptr p, size_t n, int a, int dev) { (void)p; (void)n; (void)a; (void)dev; return 0; }
#else
CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned f, void *s) {
  (void)n; (void)f; (void)s; F(cuMemPrefetchAsync_v2); ++prefetches;
  int i = find(p); if (i < 0) return 1;
  m_type[i] = loc.type; m_id[i] = loc.id; return 0;
}
CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, int a, CUmemLocation loc) { (void)p; (void)n; (void)a; (void)loc; return 0; }
#endif
static int mod_storage, fn_storage;
CUresult cuModuleLoadDataEx(void **m, const void *img, unsigned n, int *o, void **v) {
  (void)img; (void)n; (void)o; (void)v; F(cuModuleLoadDataEx); *m = &mod_storage; return 0;
}
CUresult cuModuleGetFunction(void **f, void *m, const char *name) { (void)m; (void)name; *f = &fn_storage; return 0; }
CUresult cuModuleUnload(void *m) { (void)m; return 0; }
CUresult cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e,
                        unsigned g, unsigned sh, void *s, void **p, void **x) {
  (void)f; (void)a; (void)b; (void)c; (void)d; (void)e; (void)g; (void)sh; (void)s; (void)p; (void)x;
  F(cuLaunchKernel); return 0;
}
"""

MOCK_SCRIPT = r"""
import ctypes, json, os, sys
# The module alone (importing the package would import Keras: slow).
sys.path.insert(0, os.path.join(os.environ["MOCK_PACKAGE_ROOT"], "keras_autovm", "native"))
import _autovm_native as n
lib = ctypes.CDLL("libcuda.so.1")
def state():
    a = (ctypes.c_int * 7)()
    lib.mock_state(a)
    return dict(zip(["device", "host", "managed", "events", "managed_allocs",
                     "prefetches", "fails"], list(a)))
out = {"available": n.driver_available(), "info": n.driver_info()}
try:
    out["probe"] = n.link_probe(nbytes=int(os.environ.get("MOCK_NBYTES", 4 << 20)),
                                repeats=2)
except RuntimeError as e:
    out["probe_error"] = str(e)
out["after_probe"] = state()
ptr = ctypes.c_ulonglong()
lib.cuMemAllocManaged(ctypes.byref(ptr), 1 << 20, 1)
out["fresh"] = n.pointer_info(ptr.value, 4096)
try:
    n.prefetch(ptr.value, 1 << 20, to="host")
    out["to_host"] = n.pointer_info(ptr.value, 4096)["last_prefetch_location"]
    n.prefetch(ptr.value, 1 << 20, to=0, sync=False)
    out["to_device"] = n.pointer_info(ptr.value, 4096)["last_prefetch_location"]
except RuntimeError as e:
    out["prefetch_error"] = str(e)
n.advise(ptr.value, 1 << 20, "set_preferred_location", "host")
out["unknown"] = n.pointer_info(12345)
for bad in (lambda: n.prefetch(ptr.value, 1, to="gpu"),
            lambda: n.prefetch(ptr.value, 1, to=3),
            lambda: n.advise(ptr.value, 1, "bogus", 0)):
    try:
        bad()
    except ValueError as e:
        out.setdefault("value_errors", []).append(str(e))
out["mem_info"] = list(n.mem_info())
out["device_info"] = n.device_info(0)
print("JSON" + json.dumps(out))
"""


def _mock_run(tmp_path, v1=False, **env):
    libdir = tmp_path / ("v1" if v1 else "v2")
    if not (libdir / "libcuda.so.1").exists():
        libdir.mkdir(exist_ok=True)
        (libdir / "mock.c").write_text(MOCK_LIBCUDA)
        cmd = ["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-o",
               str(libdir / "libcuda.so.1"), str(libdir / "mock.c")]
        if v1:
            cmd.insert(1, "-DMOCK_V1")
        subprocess.run(cmd, check=True)
    proc = subprocess.run(
        [sys.executable, "-c", MOCK_SCRIPT], capture_output=True, text=True,
        timeout=120,
        env={**os.environ, "LD_LIBRARY_PATH": str(libdir),
             "MOCK_PACKAGE_ROOT": str(ROOT), **env})
    assert proc.returncode == 0, proc.stderr
    import json  # noqa: PLC0415

    return json.loads(proc.stdout.split("JSON", 1)[1])


@pytest.mark.parametrize("v1", [False, True], ids=["cuda12.2+", "cuda<12.2"])
def test_mock_driver_entry_points_and_probe(nat, tmp_path, v1):
    out = _mock_run(tmp_path, v1=v1)
    assert out["available"] is True
    assert out["info"]["version"] == 13000
    if v1:
        assert out["info"]["prefetch_entry"] == "cuMemPrefetchAsync"
        assert out["info"]["advise_entry"] == "cuMemAdvise"
    else:
        assert out["info"]["prefetch_entry"] == "cuMemPrefetchAsync_v2"
        assert out["info"]["advise_entry"] == "cuMemAdvise_v2"
    probe = out["probe"]
    for key in ("pinned_d2h", "pinned_h2d", "managed_prefetch_h2d",
                "managed_prefetch_d2h", "managed_fault_h2d"):
        assert len(probe[key]["all"]) == 2
        assert probe[key]["median"] == pytest.approx(4 * 2**20 / 1e-3 / 1e9)
    assert probe["touch_ptx"].startswith(".version 7.0")
    # Everything the probe allocated was freed; one managed buffer was made.
    after = out["after_probe"]
    assert (after["device"], after["host"], after["managed"], after["events"]) == (0, 0, 0, 0)
    assert after["managed_allocs"] == 1
    assert out["fresh"]["is_managed"] is True
    assert out["fresh"]["last_prefetch_location"] == "none"
    assert out["to_host"] == "host"
    assert out["to_device"] == "device:0"
    assert out["unknown"] == {"is_managed": False, "device": -1,
                              "memory_type": "unregistered",
                              "last_prefetch_location": "none"}
    assert len(out["value_errors"]) == 3
    assert "'host' or a device ordinal" in out["value_errors"][0]
    assert "device must be in [0, 1), got 3" in out["value_errors"][1]
    assert "advice must be one of" in out["value_errors"][2]
    assert out["mem_info"] == [64 << 20, 1 << 34]
    assert out["device_info"]["name"] == "Mock GPU"


def test_mock_probe_refuses_over_a_quarter_of_free_memory(nat, tmp_path):
    out = _mock_run(tmp_path, MOCK_FREE_MIB="64", MOCK_NBYTES=str(17 << 20))
    assert "probe" not in out
    assert out["probe_error"].startswith(
        "link_probe: refusing to allocate 17825792 bytes: more than 25% of the "
        "device's free memory (67108864 bytes free)")
    assert out["after_probe"]["managed_allocs"] == 0  # Nothing was allocated.
    assert out["after_probe"]["device"] == out["after_probe"]["host"] == 0


@pytest.mark.parametrize("failing", [
    "cuMemAllocManaged", "cuMemPrefetchAsync_v2", "cuModuleLoadDataEx",
    "cuLaunchKernel", "cuMemAlloc_v2"])
def test_mock_errors_name_the_call_and_free_everything(nat, tmp_path, failing):
    out = _mock_run(tmp_path, MOCK_FAIL=failing)
    assert "probe" not in out
    assert "CUDA_ERROR_OUT_OF_MEMORY (2): out of memory" in out["probe_error"]
    assert out["probe_error"].split(" failed:")[0].endswith(
        failing.replace("_v2", "") if failing == "cuMemAlloc_v2" else failing)
    after = out["after_probe"]
    assert (after["device"], after["host"], after["managed"], after["events"]) == (0, 0, 0, 0)
    if failing == "cuMemPrefetchAsync_v2":
        assert "prefetch_error" in out  # prefetch() reports it too.


def test_mock_driver_whose_cuinit_fails(nat, tmp_path):
    _mock_run(tmp_path)  # Builds the stand-in library.
    code = ("import os, sys\n"
            "sys.path.insert(0, os.path.join(os.environ['MOCK_PACKAGE_ROOT'], 'keras_autovm', 'native'))\n"
            "import _autovm_native as n\n"
            "print(n.driver_available())\n"
            "try:\n    n.mem_info()\nexcept RuntimeError as e:\n    print(e)\n")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "LD_LIBRARY_PATH": str(tmp_path / "v2"),
             "MOCK_PACKAGE_ROOT": str(ROOT), "MOCK_FAIL": "cuInit"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "False",
        "no CUDA driver: cuInit failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"]
