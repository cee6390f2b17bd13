// Run-time loading of libcuda.so.1; see cuda_driver.h.
#include "cuda_driver.h"

#include <dlfcn.h>

#include <map>
#include <mutex>
#include <utility>

namespace autovm {
namespace cu {
namespace {

// dlsym of the first name in `names` the library exports.
template <typename Fn>
bool Resolve(void* lib, Fn* fn, std::initializer_list<const char*> names,
             const char** picked, std::string* missing) {
  for (const char* name : names) {
    void* sym = dlsym(lib, name);
    if (sym != nullptr) {
      *fn = reinterpret_cast<Fn>(sym);
      if (picked != nullptr) *picked = name;
      return true;
    }
  }
  if (!missing->empty()) *missing += ", ";
  *missing += *names.begin();
  return false;
}

struct Loaded {
  Driver driver;
  bool ok = false;
  std::string error;
};

Loaded Load() {
  Loaded out;
  // RTLD_NOLOAD first: a framework may already hold the driver open.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    out.error = std::string("libcuda.so.1 could not be loaded (") +
                (why != nullptr ? why : "unknown reason") + ")";
    return out;
  }
  Driver& d = out.driver;
  std::string missing;
  bool all = true;
#define AUTOVM_RESOLVE(member, ...) \
  all &= Resolve(lib, &d.member, {__VA_ARGS__}, nullptr, &missing)
  AUTOVM_RESOLVE(cuInit, "cuInit");
  AUTOVM_RESOLVE(cuDriverGetVersion, "cuDriverGetVersion");
  AUTOVM_RESOLVE(cuGetErrorName, "cuGetErrorName");
  AUTOVM_RESOLVE(cuGetErrorString, "cuGetErrorString");
  AUTOVM_RESOLVE(cuDeviceGetCount, "cuDeviceGetCount");
  AUTOVM_RESOLVE(cuDeviceGet, "cuDeviceGet");
  AUTOVM_RESOLVE(cuDeviceGetName, "cuDeviceGetName");
  AUTOVM_RESOLVE(cuDeviceGetAttribute, "cuDeviceGetAttribute");
  AUTOVM_RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  AUTOVM_RESOLVE(cuCtxPushCurrent, "cuCtxPushCurrent_v2");
  AUTOVM_RESOLVE(cuCtxPopCurrent, "cuCtxPopCurrent_v2");
  AUTOVM_RESOLVE(cuCtxGetDevice, "cuCtxGetDevice");
  AUTOVM_RESOLVE(cuCtxSynchronize, "cuCtxSynchronize");
  // The CUDA 12.5 cuStreamGetCtx_v2 has another signature (green contexts);
  // the original symbol stays exported for binaries built against CUDA <= 12.
  AUTOVM_RESOLVE(cuStreamGetCtx, "cuStreamGetCtx");
  AUTOVM_RESOLVE(cuStreamCreate, "cuStreamCreate");
  AUTOVM_RESOLVE(cuStreamSynchronize, "cuStreamSynchronize");
  AUTOVM_RESOLVE(cuStreamWaitEvent, "cuStreamWaitEvent");
  AUTOVM_RESOLVE(cuEventCreate, "cuEventCreate");
  AUTOVM_RESOLVE(cuEventRecord, "cuEventRecord");
  AUTOVM_RESOLVE(cuEventSynchronize, "cuEventSynchronize");
  // Same signature in both; _v2 (CUDA 12.8+) is what cuda.h 13 maps to.
  AUTOVM_RESOLVE(cuEventElapsedTime, "cuEventElapsedTime_v2",
                 "cuEventElapsedTime");
  AUTOVM_RESOLVE(cuEventDestroy, "cuEventDestroy_v2");
  AUTOVM_RESOLVE(cuMemGetInfo, "cuMemGetInfo_v2");
  AUTOVM_RESOLVE(cuMemAlloc, "cuMemAlloc_v2");
  AUTOVM_RESOLVE(cuMemFree, "cuMemFree_v2");
  AUTOVM_RESOLVE(cuMemAllocHost, "cuMemAllocHost_v2");
  AUTOVM_RESOLVE(cuMemFreeHost, "cuMemFreeHost");
  AUTOVM_RESOLVE(cuMemAllocManaged, "cuMemAllocManaged");
  AUTOVM_RESOLVE(cuMemsetD8, "cuMemsetD8_v2");
  AUTOVM_RESOLVE(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  AUTOVM_RESOLVE(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  AUTOVM_RESOLVE(cuPointerGetAttribute, "cuPointerGetAttribute");
  AUTOVM_RESOLVE(cuMemRangeGetAttribute, "cuMemRangeGetAttribute");
  AUTOVM_RESOLVE(cuModuleLoadDataEx, "cuModuleLoadDataEx");
  AUTOVM_RESOLVE(cuModuleGetFunction, "cuModuleGetFunction");
  AUTOVM_RESOLVE(cuModuleUnload, "cuModuleUnload");
  AUTOVM_RESOLVE(cuLaunchKernel, "cuLaunchKernel");
#undef AUTOVM_RESOLVE
  // Prefetch and advise: the location-struct form (CUDA 12.2+, the only one
  // in CUDA 13) when the driver exports it, else the int-device form.
  std::string unused;
  if (!Resolve(lib, &d.cuMemPrefetchAsync_v2, {"cuMemPrefetchAsync_v2"},
               &d.prefetch_entry, &unused)) {
    all &= Resolve(lib, &d.cuMemPrefetchAsync_v1, {"cuMemPrefetchAsync"},
                   &d.prefetch_entry, &missing);
  }
  if (!Resolve(lib, &d.cuMemAdvise_v2, {"cuMemAdvise_v2"}, &d.advise_entry,
               &unused)) {
    all &= Resolve(lib, &d.cuMemAdvise_v1, {"cuMemAdvise"}, &d.advise_entry,
                   &missing);
  }
  if (!all) {
    out.error = "libcuda.so.1 lacks " + missing;
    return out;
  }
  CUresult r = d.cuInit(0);
  if (r != CUDA_SUCCESS) {
    out.error = CallError(&d, "cuInit", r);
    return out;
  }
  r = d.cuDriverGetVersion(&d.version);
  if (r != CUDA_SUCCESS) {
    out.error = CallError(&d, "cuDriverGetVersion", r);
    return out;
  }
  out.ok = true;
  return out;
}

const Loaded& Instance() {
  static const Loaded* loaded = new Loaded(Load());  // Never freed.
  return *loaded;
}

}  // namespace

const Driver* GetDriver(std::string* error) {
  const Loaded& loaded = Instance();
  if (!loaded.ok) {
    if (error != nullptr) *error = loaded.error;
    return nullptr;
  }
  return &loaded.driver;
}

std::string ResultString(const Driver* d, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (d != nullptr && d->cuGetErrorName != nullptr &&
      d->cuGetErrorName(result, &name) != CUDA_SUCCESS) {
    name = nullptr;
  }
  if (d != nullptr && d->cuGetErrorString != nullptr &&
      d->cuGetErrorString(result, &text) != CUDA_SUCCESS) {
    text = nullptr;
  }
  std::string out = name != nullptr ? name : "CUresult";
  out += " (" + std::to_string(result) + ")";
  if (text != nullptr) out += std::string(": ") + text;
  return out;
}

std::string CallError(const Driver* d, const char* what, CUresult result) {
  return std::string(what) + " failed: " + ResultString(d, result);
}

CUresult Prefetch(const Driver& d, CUdeviceptr ptr, size_t nbytes,
                  int location, CUstream stream) {
  if (d.cuMemPrefetchAsync_v2 != nullptr) {
    CUmemLocation loc;
    loc.type = location == kHost ? CU_MEM_LOCATION_TYPE_HOST
                                 : CU_MEM_LOCATION_TYPE_DEVICE;
    loc.id = location == kHost ? 0 : location;
    return d.cuMemPrefetchAsync_v2(ptr, nbytes, loc, 0, stream);
  }
  return d.cuMemPrefetchAsync_v1(ptr, nbytes,
                                 location == kHost ? CU_DEVICE_CPU : location,
                                 stream);
}

CUresult Advise(const Driver& d, CUdeviceptr ptr, size_t nbytes, int advice,
                int location) {
  if (d.cuMemAdvise_v2 != nullptr) {
    CUmemLocation loc;
    loc.type = location == kHost ? CU_MEM_LOCATION_TYPE_HOST
                                 : CU_MEM_LOCATION_TYPE_DEVICE;
    loc.id = location == kHost ? 0 : location;
    return d.cuMemAdvise_v2(ptr, nbytes, advice, loc);
  }
  return d.cuMemAdvise_v1(ptr, nbytes, advice,
                          location == kHost ? CU_DEVICE_CPU : location);
}

ScopedContext::ScopedContext(const Driver& d, CUcontext ctx)
    : d_(d), status_(d.cuCtxPushCurrent(ctx)) {}

ScopedContext::~ScopedContext() {
  if (status_ == CUDA_SUCCESS) {
    CUcontext popped;
    d_.cuCtxPopCurrent(&popped);
  }
}

CUresult SideStream(const Driver& d, CUcontext ctx, int location,
                    CUstream* stream) {
  static std::mutex* mu = new std::mutex;
  static auto* streams = new std::map<std::pair<CUcontext, bool>, CUstream>;
  std::lock_guard<std::mutex> lock(*mu);
  const auto key = std::make_pair(ctx, location == kHost);
  auto it = streams->find(key);
  if (it != streams->end()) {
    *stream = it->second;
    return CUDA_SUCCESS;
  }
  ScopedContext scope(d, ctx);
  if (scope.status() != CUDA_SUCCESS) return scope.status();
  CUstream created = nullptr;
  CUresult r = d.cuStreamCreate(&created, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) return r;
  (*streams)[key] = created;
  *stream = created;
  return CUDA_SUCCESS;
}

}  // namespace cu
}  // namespace autovm
