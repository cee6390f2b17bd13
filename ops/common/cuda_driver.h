// The few CUDA driver API types, constants and entry points keras-autovm uses,
// declared here so that no CUDA header or toolkit is needed to build.
//
// libcuda.so.1 is opened at run time (dlopen) the first time GetDriver() is
// called; machines without a driver get a null Driver and an error string, so
// the libraries that include this file load everywhere.
//
// The values below are the ones of cuda.h (CUDA 12 and 13 agree on all of
// them). ops/common/check_cuda_h.cc compares them with a real cuda.h where one
// is installed (the GPU machine): build it with
//   g++ -std=c++17 -fsyntax-only -I/usr/local/cuda/include ops/common/check_cuda_h.cc
#ifndef KERAS_AUTOVM_OPS_COMMON_CUDA_DRIVER_H_
#define KERAS_AUTOVM_OPS_COMMON_CUDA_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <string>

// Opaque handle types carry cuda.h's struct tags so that they are the same
// types as cuda.h's where both headers meet (check_cuda_h.cc).
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
struct CUmod_st;
struct CUfunc_st;

namespace autovm {
namespace cu {

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;  // NOLINT: cuda.h's definition.
typedef ::CUctx_st* CUcontext;
typedef ::CUstream_st* CUstream;
typedef ::CUevent_st* CUevent;
typedef ::CUmod_st* CUmodule;
typedef ::CUfunc_st* CUfunction;

// CUmemLocation (CUDA >= 10.2): {CUmemLocationType type; int id;}.
struct CUmemLocation {
  int type;
  int id;
};

// CUresult values this code branches on (cuGetErrorName names all others).
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;

// CUpointer_attribute.
constexpr int CU_POINTER_ATTRIBUTE_CONTEXT = 1;
constexpr int CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
constexpr int CU_POINTER_ATTRIBUTE_IS_MANAGED = 8;
constexpr int CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9;

// CUmemorytype.
constexpr int CU_MEMORYTYPE_HOST = 1;
constexpr int CU_MEMORYTYPE_DEVICE = 2;
constexpr int CU_MEMORYTYPE_ARRAY = 3;
constexpr int CU_MEMORYTYPE_UNIFIED = 4;

// CUmem_range_attribute. The *_TYPE/*_ID forms exist from CUDA 12.2.
constexpr int CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION = 2;
constexpr int CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION = 4;
constexpr int CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE = 7;
constexpr int CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID = 8;

// CUmemLocationType.
constexpr int CU_MEM_LOCATION_TYPE_INVALID = 0;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_LOCATION_TYPE_HOST = 2;
constexpr int CU_MEM_LOCATION_TYPE_HOST_NUMA = 3;
constexpr int CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 4;

// CUmem_advise.
constexpr int CU_MEM_ADVISE_SET_READ_MOSTLY = 1;
constexpr int CU_MEM_ADVISE_UNSET_READ_MOSTLY = 2;
constexpr int CU_MEM_ADVISE_SET_PREFERRED_LOCATION = 3;
constexpr int CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION = 4;
constexpr int CU_MEM_ADVISE_SET_ACCESSED_BY = 5;
constexpr int CU_MEM_ADVISE_UNSET_ACCESSED_BY = 6;

// Device ids of the CUDA 12 int-device forms of prefetch/advise and of the
// legacy LAST_PREFETCH_LOCATION attribute.
constexpr int CU_DEVICE_CPU = -1;
constexpr int CU_DEVICE_INVALID = -2;

// CUdevice_attribute.
constexpr int CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 83;
constexpr int CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 89;

// Flags.
constexpr unsigned int CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned int CU_EVENT_DEFAULT = 0;
constexpr unsigned int CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned int CU_MEM_ATTACH_GLOBAL = 1;

// CUjit_option.
constexpr int CU_JIT_ERROR_LOG_BUFFER = 5;
constexpr int CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6;

// Function pointer types, one per entry point used. Names follow the exported
// symbol that is resolved (the _v2 suffixes are the ones cuda.h maps to).
typedef CUresult (*PFN_cuInit)(unsigned int);
typedef CUresult (*PFN_cuDriverGetVersion)(int*);
typedef CUresult (*PFN_cuGetErrorName)(CUresult, const char**);
typedef CUresult (*PFN_cuGetErrorString)(CUresult, const char**);
typedef CUresult (*PFN_cuDeviceGetCount)(int*);
typedef CUresult (*PFN_cuDeviceGet)(CUdevice*, int);
typedef CUresult (*PFN_cuDeviceGetName)(char*, int, CUdevice);
typedef CUresult (*PFN_cuDeviceGetAttribute)(int*, int, CUdevice);
typedef CUresult (*PFN_cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
typedef CUresult (*PFN_cuCtxPushCurrent_v2)(CUcontext);
typedef CUresult (*PFN_cuCtxPopCurrent_v2)(CUcontext*);
typedef CUresult (*PFN_cuCtxGetDevice)(CUdevice*);
typedef CUresult (*PFN_cuCtxSynchronize)();
typedef CUresult (*PFN_cuStreamGetCtx)(CUstream, CUcontext*);
typedef CUresult (*PFN_cuStreamCreate)(CUstream*, unsigned int);
typedef CUresult (*PFN_cuStreamSynchronize)(CUstream);
typedef CUresult (*PFN_cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
typedef CUresult (*PFN_cuEventCreate)(CUevent*, unsigned int);
typedef CUresult (*PFN_cuEventRecord)(CUevent, CUstream);
typedef CUresult (*PFN_cuEventSynchronize)(CUevent);
typedef CUresult (*PFN_cuEventElapsedTime)(float*, CUevent, CUevent);
typedef CUresult (*PFN_cuEventDestroy_v2)(CUevent);
typedef CUresult (*PFN_cuMemGetInfo_v2)(size_t*, size_t*);
typedef CUresult (*PFN_cuMemAlloc_v2)(CUdeviceptr*, size_t);
typedef CUresult (*PFN_cuMemFree_v2)(CUdeviceptr);
typedef CUresult (*PFN_cuMemAllocHost_v2)(void**, size_t);
typedef CUresult (*PFN_cuMemFreeHost)(void*);
typedef CUresult (*PFN_cuMemAllocManaged)(CUdeviceptr*, size_t, unsigned int);
typedef CUresult (*PFN_cuMemsetD8_v2)(CUdeviceptr, unsigned char, size_t);
typedef CUresult (*PFN_cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void*, size_t,
                                             CUstream);
typedef CUresult (*PFN_cuMemcpyDtoHAsync_v2)(void*, CUdeviceptr, size_t,
                                             CUstream);
typedef CUresult (*PFN_cuPointerGetAttribute)(void*, int, CUdeviceptr);
typedef CUresult (*PFN_cuMemRangeGetAttribute)(void*, size_t, int, CUdeviceptr,
                                               size_t);
// CUDA <= 12 form (int device, CU_DEVICE_CPU for the host).
typedef CUresult (*PFN_cuMemPrefetchAsync)(CUdeviceptr, size_t, CUdevice,
                                           CUstream);
// CUDA >= 12.2 form, the only one CUDA 13 headers declare.
typedef CUresult (*PFN_cuMemPrefetchAsync_v2)(CUdeviceptr, size_t,
                                              CUmemLocation, unsigned int,
                                              CUstream);
typedef CUresult (*PFN_cuMemAdvise)(CUdeviceptr, size_t, int, CUdevice);
typedef CUresult (*PFN_cuMemAdvise_v2)(CUdeviceptr, size_t, int,
                                       CUmemLocation);
typedef CUresult (*PFN_cuModuleLoadDataEx)(CUmodule*, const void*, unsigned int,
                                           int*, void**);
typedef CUresult (*PFN_cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
typedef CUresult (*PFN_cuModuleUnload)(CUmodule);
typedef CUresult (*PFN_cuLaunchKernel)(CUfunction, unsigned int, unsigned int,
                                       unsigned int, unsigned int, unsigned int,
                                       unsigned int, unsigned int, CUstream,
                                       void**, void**);

// The resolved entry points. Every member is non-null in a Driver returned by
// GetDriver(), except that exactly one of each prefetch/advise pair is set.
struct Driver {
  int version = 0;  // cuDriverGetVersion, e.g. 13000.
  PFN_cuInit cuInit = nullptr;
  PFN_cuDriverGetVersion cuDriverGetVersion = nullptr;
  PFN_cuGetErrorName cuGetErrorName = nullptr;
  PFN_cuGetErrorString cuGetErrorString = nullptr;
  PFN_cuDeviceGetCount cuDeviceGetCount = nullptr;
  PFN_cuDeviceGet cuDeviceGet = nullptr;
  PFN_cuDeviceGetName cuDeviceGetName = nullptr;
  PFN_cuDeviceGetAttribute cuDeviceGetAttribute = nullptr;
  PFN_cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRetain = nullptr;
  PFN_cuCtxPushCurrent_v2 cuCtxPushCurrent = nullptr;
  PFN_cuCtxPopCurrent_v2 cuCtxPopCurrent = nullptr;
  PFN_cuCtxGetDevice cuCtxGetDevice = nullptr;
  PFN_cuCtxSynchronize cuCtxSynchronize = nullptr;
  PFN_cuStreamGetCtx cuStreamGetCtx = nullptr;
  PFN_cuStreamCreate cuStreamCreate = nullptr;
  PFN_cuStreamSynchronize cuStreamSynchronize = nullptr;
  PFN_cuStreamWaitEvent cuStreamWaitEvent = nullptr;
  PFN_cuEventCreate cuEventCreate = nullptr;
  PFN_cuEventRecord cuEventRecord = nullptr;
  PFN_cuEventSynchronize cuEventSynchronize = nullptr;
  PFN_cuEventElapsedTime cuEventElapsedTime = nullptr;
  PFN_cuEventDestroy_v2 cuEventDestroy = nullptr;
  PFN_cuMemGetInfo_v2 cuMemGetInfo = nullptr;
  PFN_cuMemAlloc_v2 cuMemAlloc = nullptr;
  PFN_cuMemFree_v2 cuMemFree = nullptr;
  PFN_cuMemAllocHost_v2 cuMemAllocHost = nullptr;
  PFN_cuMemFreeHost cuMemFreeHost = nullptr;
  PFN_cuMemAllocManaged cuMemAllocManaged = nullptr;
  PFN_cuMemsetD8_v2 cuMemsetD8 = nullptr;
  PFN_cuMemcpyHtoDAsync_v2 cuMemcpyHtoDAsync = nullptr;
  PFN_cuMemcpyDtoHAsync_v2 cuMemcpyDtoHAsync = nullptr;
  PFN_cuPointerGetAttribute cuPointerGetAttribute = nullptr;
  PFN_cuMemRangeGetAttribute cuMemRangeGetAttribute = nullptr;
  PFN_cuMemPrefetchAsync cuMemPrefetchAsync_v1 = nullptr;
  PFN_cuMemPrefetchAsync_v2 cuMemPrefetchAsync_v2 = nullptr;
  PFN_cuMemAdvise cuMemAdvise_v1 = nullptr;
  PFN_cuMemAdvise_v2 cuMemAdvise_v2 = nullptr;
  PFN_cuModuleLoadDataEx cuModuleLoadDataEx = nullptr;
  PFN_cuModuleGetFunction cuModuleGetFunction = nullptr;
  PFN_cuModuleUnload cuModuleUnload = nullptr;
  PFN_cuLaunchKernel cuLaunchKernel = nullptr;

  // Which symbol each prefetch/advise call goes to, for reports.
  const char* prefetch_entry = "";
  const char* advise_entry = "";
};

// The process-wide driver, loaded and cuInit()-ed once. Returns nullptr when
// libcuda.so.1 cannot be opened, lacks an entry point, or cuInit fails; then
// *error (if given) says why. Thread-safe.
const Driver* GetDriver(std::string* error = nullptr);

// "CUDA_ERROR_OUT_OF_MEMORY (2): out of memory" for a CUresult.
std::string ResultString(const Driver* driver, CUresult result);

// "<what> failed: CUDA_ERROR_... (n): message".
std::string CallError(const Driver* driver, const char* what, CUresult result);

// Location ids for Prefetch/Advise: kHost, or a device ordinal >= 0.
constexpr int kHost = -1;

// cuMemPrefetchAsync to `location` through whichever form the driver has.
CUresult Prefetch(const Driver& d, CUdeviceptr ptr, size_t nbytes,
                  int location, CUstream stream);

// cuMemAdvise for `location` (kHost or a device) through whichever form the
// driver has.
CUresult Advise(const Driver& d, CUdeviceptr ptr, size_t nbytes, int advice,
                int location);

// Makes `ctx` current on this thread for the object's lifetime.
class ScopedContext {
 public:
  ScopedContext(const Driver& d, CUcontext ctx);
  ~ScopedContext();
  CUresult status() const { return status_; }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const Driver& d_;
  CUresult status_;
};

// The dedicated (non-blocking) stream of context `ctx` for moves in one
// direction (`location` kHost: evictions; a device: prefetches), created on
// first use with `ctx` current, then kept for the life of the process. One
// stream per direction lets evictions and prefetches use both directions of
// the link at once; moves in one direction run in issue order.
CUresult SideStream(const Driver& d, CUcontext ctx, int location,
                    CUstream* stream);

}  // namespace cu
}  // namespace autovm

#endif  // KERAS_AUTOVM_OPS_COMMON_CUDA_DRIVER_H_
