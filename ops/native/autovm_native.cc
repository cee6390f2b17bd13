// keras_autovm._autovm_native: what no framework exposes about CUDA managed
// memory — pointer attributes, prefetch/advise of raw pointers on a dedicated
// stream, and a link probe (pinned and managed bandwidth) for the planner.
//
// The driver is loaded at run time (ops/common/cuda_driver.h): the module
// imports on machines without CUDA, and every function then raises
// RuntimeError("no CUDA driver: ...").
//
// Safety: the probe never asks for more managed memory than a quarter of the
// device's free memory, and frees everything it allocated on every path.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/cuda_driver.h"

namespace py = pybind11;
namespace cu = autovm::cu;

namespace {

// ---------------------------------------------------------------- plumbing

const cu::Driver& Drv() {
  std::string why;
  const cu::Driver* d = cu::GetDriver(&why);
  if (d == nullptr) throw std::runtime_error("no CUDA driver: " + why);
  return *d;
}

void Check(const cu::Driver& d, const char* call, cu::CUresult r) {
  if (r != cu::CUDA_SUCCESS) throw std::runtime_error(cu::CallError(&d, call, r));
}

int DeviceCount(const cu::Driver& d) {
  int n = 0;
  Check(d, "cuDeviceGetCount", d.cuDeviceGetCount(&n));
  return n;
}

void CheckDevice(const cu::Driver& d, int device) {
  const int n = DeviceCount(d);
  if (device < 0 || device >= n) {
    throw py::value_error("device must be in [0, " + std::to_string(n) +
                          "), got " + std::to_string(device));
  }
}

// The primary context of `device` (the one TensorFlow, JAX and torch use),
// retained once and kept for the life of the process.
cu::CUcontext PrimaryContext(const cu::Driver& d, int device) {
  CheckDevice(d, device);
  static std::vector<cu::CUcontext>* contexts = new std::vector<cu::CUcontext>;
  static std::mutex* mu = new std::mutex;
  std::lock_guard<std::mutex> lock(*mu);
  if (contexts->size() <= static_cast<size_t>(device)) {
    contexts->resize(device + 1, nullptr);
  }
  cu::CUcontext& ctx = (*contexts)[device];
  if (ctx == nullptr) {
    cu::CUdevice dev = 0;
    Check(d, "cuDeviceGet", d.cuDeviceGet(&dev, device));
    Check(d, "cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(&ctx, dev));
  }
  return ctx;
}

// Pushes the primary context of `device` for the scope.
class OnDevice {
 public:
  OnDevice(const cu::Driver& d, int device)
      : scope_(d, PrimaryContext(d, device)) {
    Check(d, "cuCtxPushCurrent", scope_.status());
  }

 private:
  cu::ScopedContext scope_;
};

// The dedicated stream of `device` for moves to `location` (kHost or device).
cu::CUstream Side(const cu::Driver& d, int device, int location) {
  cu::CUstream s = nullptr;
  Check(d, "cuStreamCreate",
        cu::SideStream(d, PrimaryContext(d, device), location, &s));
  return s;
}

// Owners that free on every path.
struct DeviceBuffer {
  const cu::Driver& d;
  cu::CUdeviceptr ptr = 0;
  explicit DeviceBuffer(const cu::Driver& drv) : d(drv) {}
  ~DeviceBuffer() {
    if (ptr != 0) d.cuMemFree(ptr);
  }
};
struct HostBuffer {
  const cu::Driver& d;
  void* ptr = nullptr;
  explicit HostBuffer(const cu::Driver& drv) : d(drv) {}
  ~HostBuffer() {
    if (ptr != nullptr) d.cuMemFreeHost(ptr);
  }
};
struct Event {
  const cu::Driver& d;
  cu::CUevent ev = nullptr;
  Event(const cu::Driver& drv, unsigned int flags) : d(drv) {
    Check(d, "cuEventCreate", d.cuEventCreate(&ev, flags));
  }
  ~Event() {
    if (ev != nullptr) d.cuEventDestroy(ev);
  }
};
struct Module {
  const cu::Driver& d;
  cu::CUmodule mod = nullptr;
  explicit Module(const cu::Driver& drv) : d(drv) {}
  ~Module() {
    if (mod != nullptr) d.cuModuleUnload(mod);
  }
};

// `to` of prefetch/advise: "host" or a device ordinal.
int Location(const cu::Driver& d, const py::object& to) {
  if (py::isinstance<py::str>(to)) {
    if (to.cast<std::string>() == "host") return cu::kHost;
  } else if (py::isinstance<py::int_>(to) && !py::isinstance<py::bool_>(to)) {
    const int device = to.cast<int>();
    CheckDevice(d, device);
    return device;
  }
  throw py::value_error("location must be 'host' or a device ordinal, got " +
                        std::string(py::repr(to)));
}

int AdviceCode(const py::object& advice) {
  if (py::isinstance<py::int_>(advice)) {
    const int code = advice.cast<int>();
    if (code >= cu::CU_MEM_ADVISE_SET_READ_MOSTLY &&
        code <= cu::CU_MEM_ADVISE_UNSET_ACCESSED_BY) {
      return code;
    }
  } else if (py::isinstance<py::str>(advice)) {
    const std::string a = advice.cast<std::string>();
    if (a == "set_read_mostly") return cu::CU_MEM_ADVISE_SET_READ_MOSTLY;
    if (a == "unset_read_mostly") return cu::CU_MEM_ADVISE_UNSET_READ_MOSTLY;
    if (a == "set_preferred_location") {
      return cu::CU_MEM_ADVISE_SET_PREFERRED_LOCATION;
    }
    if (a == "unset_preferred_location") {
      return cu::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION;
    }
    if (a == "set_accessed_by") return cu::CU_MEM_ADVISE_SET_ACCESSED_BY;
    if (a == "unset_accessed_by") return cu::CU_MEM_ADVISE_UNSET_ACCESSED_BY;
  }
  throw py::value_error(
      "advice must be one of 'set_preferred_location', "
      "'unset_preferred_location', 'set_accessed_by', 'unset_accessed_by', "
      "'set_read_mostly', 'unset_read_mostly' (or its CUmem_advise value), "
      "got " + std::string(py::repr(advice)));
}

// Device ordinal of a pointer the driver knows, or -1.
int PointerDevice(const cu::Driver& d, cu::CUdeviceptr ptr) {
  int ordinal = -1;
  cu::CUresult r = d.cuPointerGetAttribute(
      &ordinal, cu::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
  return r == cu::CUDA_SUCCESS ? ordinal : -1;
}

std::string LocationName(int type, int id) {
  switch (type) {
    case cu::CU_MEM_LOCATION_TYPE_DEVICE:
      return "device:" + std::to_string(id);
    case cu::CU_MEM_LOCATION_TYPE_HOST:
    case cu::CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case cu::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
      return "host";
    default:
      return "none";
  }
}

// ------------------------------------------------------------- functions

bool DriverAvailable() { return cu::GetDriver() != nullptr; }

py::dict DriverInfo() {
  std::string why;
  const cu::Driver* d = cu::GetDriver(&why);
  py::dict out;
  out["available"] = d != nullptr;
  out["error"] = d != nullptr ? std::string() : why;
  out["version"] = d != nullptr ? d->version : 0;
  out["prefetch_entry"] = d != nullptr ? d->prefetch_entry : "";
  out["advise_entry"] = d != nullptr ? d->advise_entry : "";
  return out;
}

int DeviceCountPy() { return DeviceCount(Drv()); }

py::dict DeviceInfo(int device) {
  const cu::Driver& d = Drv();
  CheckDevice(d, device);
  cu::CUdevice dev = 0;
  Check(d, "cuDeviceGet", d.cuDeviceGet(&dev, device));
  char name[256] = {0};
  Check(d, "cuDeviceGetName", d.cuDeviceGetName(name, sizeof(name) - 1, dev));
  int managed = 0, concurrent = 0;
  Check(d, "cuDeviceGetAttribute(MANAGED_MEMORY)",
        d.cuDeviceGetAttribute(&managed, cu::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY,
                               dev));
  Check(d, "cuDeviceGetAttribute(CONCURRENT_MANAGED_ACCESS)",
        d.cuDeviceGetAttribute(
            &concurrent, cu::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
            dev));
  py::dict out;
  out["name"] = std::string(name);
  out["managed_memory"] = managed != 0;
  out["concurrent_managed_access"] = concurrent != 0;
  out["driver_version"] = d.version;
  return out;
}

std::pair<size_t, size_t> MemInfoRaw(const cu::Driver& d, int device) {
  OnDevice on(d, device);
  size_t free_bytes = 0, total = 0;
  Check(d, "cuMemGetInfo", d.cuMemGetInfo(&free_bytes, &total));
  return {free_bytes, total};
}

py::tuple MemInfo(int device) {
  const cu::Driver& d = Drv();
  auto info = MemInfoRaw(d, device);
  return py::make_tuple(info.first, info.second);
}

py::dict PointerInfo(uint64_t ptr_value, size_t nbytes) {
  const cu::Driver& d = Drv();
  if (nbytes == 0) throw py::value_error("nbytes must be positive, got 0");
  // Some attribute queries want a current context; any device's will do.
  OnDevice on(d, 0);
  const auto ptr = static_cast<cu::CUdeviceptr>(ptr_value);
  py::dict out;
  unsigned int managed = 0;
  cu::CUresult r =
      d.cuPointerGetAttribute(&managed, cu::CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr);
  if (r == cu::CUDA_ERROR_INVALID_VALUE) {
    // Not memory the driver knows (plain host memory).
    out["is_managed"] = false;
    out["device"] = -1;
    out["memory_type"] = "unregistered";
    out["last_prefetch_location"] = "none";
    return out;
  }
  Check(d, "cuPointerGetAttribute(IS_MANAGED)", r);
  unsigned int mem_type = 0;
  Check(d, "cuPointerGetAttribute(MEMORY_TYPE)",
        d.cuPointerGetAttribute(&mem_type, cu::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                ptr));
  const int device = PointerDevice(d, ptr);
  out["is_managed"] = managed != 0;
  out["device"] = device;
  switch (mem_type) {
    case cu::CU_MEMORYTYPE_HOST: out["memory_type"] = "host"; break;
    case cu::CU_MEMORYTYPE_DEVICE: out["memory_type"] = "device"; break;
    case cu::CU_MEMORYTYPE_ARRAY: out["memory_type"] = "array"; break;
    case cu::CU_MEMORYTYPE_UNIFIED: out["memory_type"] = "unified"; break;
    default: out["memory_type"] = std::to_string(mem_type);
  }
  std::string where = "none";
  if (managed) {
    // The location-type form (CUDA 12.2+) first, the legacy int form else.
    int type = 0, id = 0;
    r = d.cuMemRangeGetAttribute(
        &type, sizeof(type), cu::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE,
        ptr, nbytes);
    if (r == cu::CUDA_SUCCESS) {
      if (type == cu::CU_MEM_LOCATION_TYPE_DEVICE) {
        Check(d, "cuMemRangeGetAttribute(LAST_PREFETCH_LOCATION_ID)",
              d.cuMemRangeGetAttribute(
                  &id, sizeof(id),
                  cu::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID, ptr,
                  nbytes));
      }
      where = LocationName(type, id);
    } else {
      int legacy = cu::CU_DEVICE_INVALID;
      Check(d, "cuMemRangeGetAttribute(LAST_PREFETCH_LOCATION)",
            d.cuMemRangeGetAttribute(
                &legacy, sizeof(legacy),
                cu::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, ptr, nbytes));
      where = legacy == cu::CU_DEVICE_CPU
                  ? "host"
                  : legacy >= 0 ? "device:" + std::to_string(legacy) : "none";
    }
  }
  out["last_prefetch_location"] = where;
  return out;
}

void PrefetchPy(uint64_t ptr_value, size_t nbytes, const py::object& to,
                bool sync) {
  const cu::Driver& d = Drv();
  const int location = Location(d, to);
  const auto ptr = static_cast<cu::CUdeviceptr>(ptr_value);
  int device = location;
  if (device == cu::kHost) device = std::max(0, PointerDevice(d, ptr));
  cu::CUstream side = Side(d, device, location);
  OnDevice on(d, device);
  Check(d, d.prefetch_entry, cu::Prefetch(d, ptr, nbytes, location, side));
  if (sync) {
    cu::CUresult r;
    {
      py::gil_scoped_release release;
      r = d.cuStreamSynchronize(side);
    }
    Check(d, "cuStreamSynchronize", r);
  }
}

void AdvisePy(uint64_t ptr_value, size_t nbytes, const py::object& advice,
              const py::object& device) {
  const cu::Driver& d = Drv();
  const int code = AdviceCode(advice);
  const int location = Location(d, device);
  const auto ptr = static_cast<cu::CUdeviceptr>(ptr_value);
  OnDevice on(d, location == cu::kHost ? std::max(0, PointerDevice(d, ptr))
                                       : location);
  Check(d, d.advise_entry, cu::Advise(d, ptr, nbytes, code, location));
}

void Synchronize(int device) {
  const cu::Driver& d = Drv();
  OnDevice on(d, device);
  cu::CUresult r;
  {
    py::gil_scoped_release release;
    r = d.cuCtxSynchronize();
  }
  Check(d, "cuCtxSynchronize", r);
}

// ------------------------------------------------------------ link probe

// Adds 1 to one 32-bit word every `stride` words of `p[0:n)`: one touch per
// page, so a buffer resident on the host migrates to the GPU by faults.
// Hand-written PTX, JIT-compiled by the driver (no toolkit needed).
const char* kTouchPtxBody = R"(
.visible .entry autovm_touch(
    .param .u64 p_ptr,
    .param .u64 p_n,
    .param .u64 p_stride
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [p_ptr];
    ld.param.u64 %rd2, [p_n];
    ld.param.u64 %rd3, [p_stride];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mad.lo.s32 %r4, %r1, %r2, %r3;
    cvt.u64.u32 %rd4, %r4;
    mov.u32 %r5, %nctaid.x;
    mul.lo.s32 %r6, %r5, %r2;
    cvt.u64.u32 %rd5, %r6;
    mul.lo.u64 %rd6, %rd4, %rd3;
    mul.lo.u64 %rd7, %rd5, %rd3;
LOOP:
    setp.ge.u64 %p1, %rd6, %rd2;
    @%p1 bra DONE;
    shl.b64 %rd8, %rd6, 2;
    add.s64 %rd9, %rd1, %rd8;
    ld.global.u32 %r7, [%rd9];
    add.s32 %r7, %r7, 1;
    st.global.u32 [%rd9], %r7;
    add.s64 %rd6, %rd6, %rd7;
    bra LOOP;
DONE:
    ret;
}
)";

// Loads the touch kernel, trying an old PTX ISA/target first (accepted by
// CUDA 12 and 13 drivers) and a Hopper-era one if the driver refuses it.
cu::CUfunction LoadTouch(const cu::Driver& d, Module* module,
                         std::string* header_used) {
  const char* headers[] = {
      ".version 7.0\n.target sm_60\n.address_size 64\n",
      ".version 8.0\n.target sm_90\n.address_size 64\n",
  };
  std::string errors;
  for (const char* header : headers) {
    const std::string ptx = std::string(header) + kTouchPtxBody;
    char log[4096] = {0};
    int options[] = {cu::CU_JIT_ERROR_LOG_BUFFER,
                     cu::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void* values[] = {log, reinterpret_cast<void*>(sizeof(log) - 1)};
    cu::CUresult r =
        d.cuModuleLoadDataEx(&module->mod, ptx.c_str(), 2, options, values);
    if (r == cu::CUDA_SUCCESS) {
      cu::CUfunction fn = nullptr;
      Check(d, "cuModuleGetFunction",
            d.cuModuleGetFunction(&fn, module->mod, "autovm_touch"));
      *header_used = header;
      return fn;
    }
    module->mod = nullptr;
    errors += cu::CallError(&d, "cuModuleLoadDataEx", r) + " [" + log + "]; ";
  }
  throw std::runtime_error("the touch kernel did not load: " + errors);
}

double Gbps(size_t nbytes, float ms) {
  return ms > 0 ? static_cast<double>(nbytes) / (ms * 1e-3) / 1e9 : 0.0;
}

// Everything the probe measures, with the GIL released (no Python here).
struct ProbeResult {
  std::vector<double> pinned_d2h, pinned_h2d, managed_h2d, managed_d2h,
      fault_h2d;
  double first_eviction = 0;
  std::string ptx_header;
  size_t free_before = 0, total = 0;
};

ProbeResult RunProbe(const cu::Driver& d, size_t nbytes, int repeats,
                     int device) {
  ProbeResult res;
  OnDevice on(d, device);
  Check(d, "cuMemGetInfo", d.cuMemGetInfo(&res.free_before, &res.total));
  // SAFETY: managed memory must stay well inside free device memory
  // (oversubscribing it can hang a shared GPU). The same cap is applied to
  // the plain device buffer of the pinned test.
  if (nbytes > res.free_before / 4) {
    throw std::runtime_error(
        "link_probe: refusing to allocate " + std::to_string(nbytes) +
        " bytes: more than 25% of the device's free memory (" +
        std::to_string(res.free_before) + " bytes free)");
  }
  // One stream for the whole probe: its steps must not overlap.
  cu::CUstream stream = Side(d, device, device);
  Event start(d, cu::CU_EVENT_DEFAULT), stop(d, cu::CU_EVENT_DEFAULT);
  auto timed = [&](auto&& enqueue, const char* what) -> double {
    Check(d, "cuEventRecord", d.cuEventRecord(start.ev, stream));
    enqueue();
    Check(d, "cuEventRecord", d.cuEventRecord(stop.ev, stream));
    Check(d, "cuEventSynchronize", d.cuEventSynchronize(stop.ev));
    float ms = 0;
    Check(d, "cuEventElapsedTime", d.cuEventElapsedTime(&ms, start.ev, stop.ev));
    (void)what;
    return Gbps(nbytes, ms);
  };

  // Pinned copies.
  {
    HostBuffer host(d);
    DeviceBuffer dev(d);
    Check(d, "cuMemAllocHost", d.cuMemAllocHost(&host.ptr, nbytes));
    Check(d, "cuMemAlloc", d.cuMemAlloc(&dev.ptr, nbytes));
    std::memset(host.ptr, 1, nbytes);
    Check(d, "cuMemsetD8", d.cuMemsetD8(dev.ptr, 2, nbytes));
    auto d2h = [&] {
      Check(d, "cuMemcpyDtoHAsync",
            d.cuMemcpyDtoHAsync(host.ptr, dev.ptr, nbytes, stream));
    };
    auto h2d = [&] {
      Check(d, "cuMemcpyHtoDAsync",
            d.cuMemcpyHtoDAsync(dev.ptr, host.ptr, nbytes, stream));
    };
    timed(d2h, "warm-up");
    timed(h2d, "warm-up");
    for (int i = 0; i < repeats; ++i) res.pinned_d2h.push_back(timed(d2h, "d2h"));
    for (int i = 0; i < repeats; ++i) res.pinned_h2d.push_back(timed(h2d, "h2d"));
  }

  // Managed memory: explicit prefetch both ways, then fault-driven migration.
  {
    DeviceBuffer managed(d);
    Check(d, "cuMemAllocManaged",
          d.cuMemAllocManaged(&managed.ptr, nbytes, cu::CU_MEM_ATTACH_GLOBAL));
    const cu::CUdeviceptr m = managed.ptr;
    auto to_device = [&] {
      Check(d, d.prefetch_entry, cu::Prefetch(d, m, nbytes, device, stream));
    };
    auto to_host = [&] {
      Check(d, d.prefetch_entry, cu::Prefetch(d, m, nbytes, cu::kHost, stream));
    };
    // Populate on the GPU, then the first eviction (host pages are new).
    Check(d, "cuMemsetD8", d.cuMemsetD8(m, 3, nbytes));
    Check(d, "cuStreamSynchronize", d.cuStreamSynchronize(nullptr));
    to_device();
    Check(d, "cuStreamSynchronize", d.cuStreamSynchronize(stream));
    res.first_eviction = timed(to_host, "first eviction");
    for (int i = 0; i < repeats; ++i) {
      res.managed_h2d.push_back(timed(to_device, "managed h2d"));
      res.managed_d2h.push_back(timed(to_host, "managed d2h"));
    }

    Module module(d);
    cu::CUfunction touch = LoadTouch(d, &module, &res.ptx_header);
    unsigned long long n_words = nbytes / 4;
    unsigned long long stride = 4096 / 4;  // One word per 4 KiB page.
    const unsigned int threads = 256;
    const unsigned long long pages = (n_words + stride - 1) / stride;
    const unsigned int blocks = static_cast<unsigned int>(
        std::max<unsigned long long>(
            1, std::min<unsigned long long>((pages + threads - 1) / threads,
                                            65535)));
    void* args[] = {const_cast<cu::CUdeviceptr*>(&m), &n_words, &stride};
    auto launch = [&] {
      Check(d, "cuLaunchKernel",
            d.cuLaunchKernel(touch, blocks, 1, 1, threads, 1, 1, 0, stream,
                             args, nullptr));
    };
    for (int i = 0; i < repeats; ++i) {
      to_host();  // Start from host residency (untimed).
      Check(d, "cuStreamSynchronize", d.cuStreamSynchronize(stream));
      res.fault_h2d.push_back(timed(launch, "fault h2d"));
    }
    Check(d, "cuStreamSynchronize", d.cuStreamSynchronize(stream));
  }
  return res;
}

py::dict Summary(const std::vector<double>& v) {
  std::vector<double> s(v);
  std::sort(s.begin(), s.end());
  py::dict out;
  out["median"] = s.empty() ? 0.0 : s[s.size() / 2];
  out["max"] = s.empty() ? 0.0 : s.back();
  out["min"] = s.empty() ? 0.0 : s.front();
  out["all"] = v;
  return out;
}

py::dict LinkProbe(size_t nbytes, int repeats, int device) {
  if (nbytes < (1 << 20)) {
    throw py::value_error("nbytes must be at least 1 MiB, got " +
                          std::to_string(nbytes));
  }
  if (repeats < 1) {
    throw py::value_error("repeats must be >= 1, got " +
                          std::to_string(repeats));
  }
  const cu::Driver& d = Drv();
  CheckDevice(d, device);
  PrimaryContext(d, device);
  ProbeResult res;
  {
    py::gil_scoped_release release;
    res = RunProbe(d, nbytes, repeats, device);
  }
  py::dict out;
  out["unit"] = "GB/s (1e9 bytes per second)";
  out["nbytes"] = nbytes;
  out["repeats"] = repeats;
  out["device"] = device;
  out["free_bytes_before"] = res.free_before;
  out["total_bytes"] = res.total;
  out["pinned_d2h"] = Summary(res.pinned_d2h);
  out["pinned_h2d"] = Summary(res.pinned_h2d);
  out["managed_prefetch_h2d"] = Summary(res.managed_h2d);
  out["managed_prefetch_d2h"] = Summary(res.managed_d2h);
  out["managed_first_eviction"] = res.first_eviction;
  out["managed_fault_h2d"] = Summary(res.fault_h2d);
  out["prefetch_entry"] = d.prefetch_entry;
  out["touch_ptx"] = res.ptx_header;
  return out;
}

}  // namespace

PYBIND11_MODULE(_autovm_native, m) {
  m.doc() =
      "CUDA driver helpers of keras-autovm (libcuda loaded at run time).";
  m.def("driver_available", &DriverAvailable,
        "Whether libcuda.so.1 loaded and cuInit succeeded.");
  m.def("driver_info", &DriverInfo,
        "dict(available, error, version, prefetch_entry, advise_entry).");
  m.def("device_count", &DeviceCountPy, "Number of CUDA devices.");
  m.def("device_info", &DeviceInfo, py::arg("device") = 0,
        "dict(name, managed_memory, concurrent_managed_access, "
        "driver_version).");
  m.def("mem_info", &MemInfo, py::arg("device") = 0,
        "(free, total) bytes of `device` (cuMemGetInfo).");
  m.def("pointer_info", &PointerInfo, py::arg("ptr"), py::arg("nbytes") = 1,
        "dict(is_managed, device, memory_type, last_prefetch_location) of "
        "the range [ptr, ptr + nbytes); last_prefetch_location is 'host', "
        "'device:N' or 'none' (the last requested prefetch, not residency).");
  m.def("prefetch", &PrefetchPy, py::arg("ptr"), py::arg("nbytes"),
        py::arg("to") = "host", py::arg("sync") = true,
        "cuMemPrefetchAsync of a managed range to 'host' or a device, on the "
        "device's dedicated stream; waits for it when sync.");
  m.def("advise", &AdvisePy, py::arg("ptr"), py::arg("nbytes"),
        py::arg("advice"), py::arg("device"),
        "cuMemAdvise of a managed range; device is 'host' or an ordinal.");
  m.def("synchronize", &Synchronize, py::arg("device") = 0,
        "cuCtxSynchronize on the device's primary context (all its streams, "
        "the dedicated prefetch streams included).");
  m.def("link_probe", &LinkProbe, py::arg("nbytes") = size_t(256) << 20,
        py::arg("repeats") = 5, py::arg("device") = 0,
        "Measured GB/s: pinned D2H/H2D copies, managed prefetch both ways, "
        "first eviction, fault-driven migration to the GPU. Refuses a size "
        "over 25% of the free device memory.");
}
