// Compile-time check of cuda_driver.h against a real cuda.h (not part of any
// library; needs the CUDA headers):
//   g++ -std=c++17 -fsyntax-only -I/usr/local/cuda/include ops/common/check_cuda_h.cc
// recipes/gpu_managed_ops.py runs it on the GPU machine.
#include <cstddef>
#include <type_traits>

// First: cuda.h defines some of these names as macros (CU_DEVICE_CPU, and
// cuMemGetInfo -> cuMemGetInfo_v2 and the like).
#include "cuda_driver.h"

namespace cu = autovm::cu;
constexpr int kOurDeviceCpu = cu::CU_DEVICE_CPU;
constexpr int kOurDeviceInvalid = cu::CU_DEVICE_INVALID;

#include <cuda.h>

#define SAME(name) static_assert(static_cast<long>(cu::name) == \
                                 static_cast<long>(::name), #name)

SAME(CUDA_SUCCESS);
SAME(CUDA_ERROR_INVALID_VALUE);
SAME(CUDA_ERROR_NOT_READY);
SAME(CU_POINTER_ATTRIBUTE_CONTEXT);
SAME(CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
SAME(CU_POINTER_ATTRIBUTE_IS_MANAGED);
SAME(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
SAME(CU_MEMORYTYPE_HOST);
SAME(CU_MEMORYTYPE_DEVICE);
SAME(CU_MEMORYTYPE_ARRAY);
SAME(CU_MEMORYTYPE_UNIFIED);
SAME(CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION);
SAME(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION);
SAME(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE);
SAME(CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID);
SAME(CU_MEM_LOCATION_TYPE_INVALID);
SAME(CU_MEM_LOCATION_TYPE_DEVICE);
SAME(CU_MEM_LOCATION_TYPE_HOST);
SAME(CU_MEM_LOCATION_TYPE_HOST_NUMA);
SAME(CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT);
SAME(CU_MEM_ADVISE_SET_READ_MOSTLY);
SAME(CU_MEM_ADVISE_UNSET_READ_MOSTLY);
SAME(CU_MEM_ADVISE_SET_PREFERRED_LOCATION);
SAME(CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION);
SAME(CU_MEM_ADVISE_SET_ACCESSED_BY);
SAME(CU_MEM_ADVISE_UNSET_ACCESSED_BY);
static_assert(kOurDeviceCpu == CU_DEVICE_CPU, "CU_DEVICE_CPU");
static_assert(kOurDeviceInvalid == CU_DEVICE_INVALID, "CU_DEVICE_INVALID");
SAME(CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY);
SAME(CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS);
SAME(CU_STREAM_NON_BLOCKING);
SAME(CU_EVENT_DEFAULT);
SAME(CU_EVENT_DISABLE_TIMING);
SAME(CU_MEM_ATTACH_GLOBAL);
SAME(CU_JIT_ERROR_LOG_BUFFER);
SAME(CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES);

static_assert(std::is_same<cu::CUcontext, ::CUcontext>::value, "CUcontext");
static_assert(std::is_same<cu::CUstream, ::CUstream>::value, "CUstream");
static_assert(std::is_same<cu::CUevent, ::CUevent>::value, "CUevent");
static_assert(std::is_same<cu::CUmodule, ::CUmodule>::value, "CUmodule");
static_assert(std::is_same<cu::CUfunction, ::CUfunction>::value, "CUfunction");
static_assert(std::is_same<cu::CUdeviceptr, ::CUdeviceptr>::value,
              "CUdeviceptr");
static_assert(std::is_same<cu::CUdevice, ::CUdevice>::value, "CUdevice");
static_assert(sizeof(cu::CUresult) == sizeof(::CUresult), "CUresult");
static_assert(sizeof(cu::CUmemLocation) == sizeof(::CUmemLocation),
              "CUmemLocation size");
static_assert(offsetof(cu::CUmemLocation, type) ==
                  offsetof(::CUmemLocation, type),
              "CUmemLocation.type");
static_assert(offsetof(cu::CUmemLocation, id) == offsetof(::CUmemLocation, id),
              "CUmemLocation.id");

// The v2 prefetch signature, parameter by parameter (enums are int-sized).
static_assert(std::is_same<decltype(&::cuMemPrefetchAsync_v2),
                           CUresult (*)(CUdeviceptr, size_t, CUmemLocation,
                                        unsigned int, CUstream)>::value,
              "cuMemPrefetchAsync_v2 signature");
static_assert(std::is_same<decltype(&::cuMemAdvise_v2),
                           CUresult (*)(CUdeviceptr, size_t, CUmem_advise,
                                        CUmemLocation)>::value,
              "cuMemAdvise_v2 signature");

int main() { return 0; }
