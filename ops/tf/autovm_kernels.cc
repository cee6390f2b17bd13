// Kernels of the keras-autovm TensorFlow ops (registrations in autovm_ops.cc).
//
// GPU kernels of AutovmEvict/AutovmPrefetch (the pattern of horovod's
// mpi_ops.cc): record an event on the op's compute stream, make the device's
// dedicated stream wait on it, and enqueue cuMemPrefetchAsync of each managed
// target there (one dedicated stream per device and direction). The CUDA driver is reached through ops/common/cuda_driver.h
// (dlopen of libcuda.so.1), so no CUDA toolkit is needed to build.
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/cuda_driver.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "xla/stream_executor/stream.h"

namespace tensorflow {
namespace {

namespace cu = ::autovm::cu;

// Process-wide counters (AutovmStats).
enum Counter {
  kOpsIssued = 0,
  kBytesEvicted,
  kBytesPrefetched,
  kTensorsSkipped,
  kErrors,
  kNumCounters
};
std::atomic<int64_t> g_counters[kNumCounters];

void Count(Counter c, int64_t n) {
  g_counters[c].fetch_add(n, std::memory_order_relaxed);
}

// Identity on input 0: forwards the buffer, no copy.
void ForwardData(OpKernelContext* ctx) { ctx->set_output(0, ctx->input(0)); }

// CPU kernel of every page-moving op, and GPU kernel of AutovmBackwardPrefetch.
class AutovmIdentityOp : public OpKernel {
 public:
  explicit AutovmIdentityOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override { ForwardData(ctx); }
  bool IsExpensive() override { return false; }
};

// RAII for a CUDA event, destroyed on every path (the driver defers the
// release of an event still pending in a stream until it completes).
class ScopedEvent {
 public:
  explicit ScopedEvent(const cu::Driver& d) : d_(d) {}
  ~ScopedEvent() {
    if (event_ != nullptr) d_.cuEventDestroy(event_);
  }
  cu::CUresult Create() {
    return d_.cuEventCreate(&event_, cu::CU_EVENT_DISABLE_TIMING);
  }
  cu::CUevent get() const { return event_; }

 private:
  const cu::Driver& d_;
  cu::CUevent event_ = nullptr;
};

// GPU kernel of AutovmEvict (to_host) and AutovmPrefetch.
class AutovmMoveGpuOp : public OpKernel {
 public:
  AutovmMoveGpuOp(OpKernelConstruction* ctx, bool to_host)
      : OpKernel(ctx), to_host_(to_host) {
    if (!to_host_) {
      OP_REQUIRES_OK(ctx, ctx->GetAttr("pre_access", &pre_access_));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    ForwardData(ctx);
    OpInputList targets;
    OP_REQUIRES_OK(ctx, ctx->input_list("targets", &targets));
    if (targets.size() == 0) return;
    absl::Status status = Move(ctx, targets);
    if (!status.ok()) {
      Count(kErrors, 1);
      ctx->SetStatus(status);
    }
  }

  bool IsExpensive() override { return false; }

 private:
  absl::Status Fail(const cu::Driver* d, const char* call, cu::CUresult r) {
    return absl::InternalError(type_string() + " (" + name() + "): " +
                               cu::CallError(d, call, r));
  }

  absl::Status Move(OpKernelContext* ctx, const OpInputList& targets) {
    std::string why;
    const cu::Driver* d = cu::GetDriver(&why);
    if (d == nullptr) {
      return absl::InternalError(type_string() + " (" + name() +
                                 "): no CUDA driver: " + why);
    }
    DeviceContext* dc = ctx->op_device_context();
    if (dc == nullptr || dc->stream() == nullptr) {
      return absl::InternalError(type_string() + " (" + name() +
                                 "): the op's device has no GPU stream");
    }
    auto compute = static_cast<cu::CUstream>(
        dc->stream()->platform_specific_handle().stream);
    if (compute == nullptr) {
      return absl::InternalError(type_string() + " (" + name() +
                                 "): the GPU stream has no CUDA handle");
    }
    cu::CUcontext cuda_ctx = nullptr;
    cu::CUresult r = d->cuStreamGetCtx(compute, &cuda_ctx);
    if (r != cu::CUDA_SUCCESS) return Fail(d, "cuStreamGetCtx", r);
    cu::ScopedContext scope(*d, cuda_ctx);
    if (scope.status() != cu::CUDA_SUCCESS) {
      return Fail(d, "cuCtxPushCurrent", scope.status());
    }

    // Which targets are managed memory: only those can be prefetched.
    std::vector<std::pair<cu::CUdeviceptr, size_t>> ranges;
    ranges.reserve(targets.size());
    int64_t skipped = 0;
    for (int i = 0; i < targets.size(); ++i) {
      const Tensor& t = targets[i];
      const size_t nbytes = t.TotalBytes();
      const void* data = nbytes > 0 ? t.tensor_data().data() : nullptr;
      if (data == nullptr) {
        ++skipped;
        continue;
      }
      auto ptr = reinterpret_cast<cu::CUdeviceptr>(data);
      unsigned int managed = 0;
      r = d->cuPointerGetAttribute(&managed, cu::CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                   ptr);
      // INVALID_VALUE: memory the driver does not know (a host buffer).
      if (r == cu::CUDA_ERROR_INVALID_VALUE || (r == cu::CUDA_SUCCESS && !managed)) {
        ++skipped;
        continue;
      }
      if (r != cu::CUDA_SUCCESS) {
        return Fail(d, "cuPointerGetAttribute(IS_MANAGED)", r);
      }
      ranges.emplace_back(ptr, nbytes);
    }
    if (skipped > 0) Count(kTensorsSkipped, skipped);
    if (ranges.empty()) return absl::OkStatus();

    int location = cu::kHost;
    if (!to_host_) {
      cu::CUdevice device = 0;
      r = d->cuCtxGetDevice(&device);
      if (r != cu::CUDA_SUCCESS) return Fail(d, "cuCtxGetDevice", r);
      location = device;
    }
    cu::CUstream side = nullptr;
    r = cu::SideStream(*d, cuda_ctx, location, &side);
    if (r != cu::CUDA_SUCCESS) return Fail(d, "cuStreamCreate", r);

    // Side stream after everything enqueued so far on the compute stream (the
    // readers of the targets), never the other way round for an evict.
    ScopedEvent ready(*d);
    r = ready.Create();
    if (r != cu::CUDA_SUCCESS) return Fail(d, "cuEventCreate", r);
    r = d->cuEventRecord(ready.get(), compute);
    if (r != cu::CUDA_SUCCESS) return Fail(d, "cuEventRecord", r);
    r = d->cuStreamWaitEvent(side, ready.get(), 0);
    if (r != cu::CUDA_SUCCESS) return Fail(d, "cuStreamWaitEvent", r);

    int64_t bytes = 0;
    for (const auto& range : ranges) {
      r = cu::Prefetch(*d, range.first, range.second, location, side);
      if (r != cu::CUDA_SUCCESS) return Fail(d, d->prefetch_entry, r);
      bytes += static_cast<int64_t>(range.second);
    }
    Count(to_host_ ? kBytesEvicted : kBytesPrefetched, bytes);
    Count(kOpsIssued, 1);

    if (pre_access_) {
      ScopedEvent moved(*d);
      r = moved.Create();
      if (r != cu::CUDA_SUCCESS) return Fail(d, "cuEventCreate", r);
      r = d->cuEventRecord(moved.get(), side);
      if (r != cu::CUDA_SUCCESS) return Fail(d, "cuEventRecord", r);
      r = d->cuStreamWaitEvent(compute, moved.get(), 0);
      if (r != cu::CUDA_SUCCESS) return Fail(d, "cuStreamWaitEvent", r);
    }
    return absl::OkStatus();
  }

  const bool to_host_;
  bool pre_access_ = false;
};

class AutovmEvictGpuOp : public AutovmMoveGpuOp {
 public:
  explicit AutovmEvictGpuOp(OpKernelConstruction* ctx)
      : AutovmMoveGpuOp(ctx, /*to_host=*/true) {}
};

class AutovmPrefetchGpuOp : public AutovmMoveGpuOp {
 public:
  explicit AutovmPrefetchGpuOp(OpKernelConstruction* ctx)
      : AutovmMoveGpuOp(ctx, /*to_host=*/false) {}
};

class AutovmStatsOp : public OpKernel {
 public:
  explicit AutovmStatsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({kNumCounters}),
                                             &out));
    auto flat = out->flat<int64_t>();
    for (int i = 0; i < kNumCounters; ++i) {
      flat(i) = g_counters[i].load(std::memory_order_relaxed);
    }
  }
};

class AutovmResetStatsOp : public OpKernel {
 public:
  explicit AutovmResetStatsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* /*ctx*/) override {
    for (auto& counter : g_counters) counter.store(0, std::memory_order_relaxed);
  }
};

class AutovmPointerOp : public OpKernel {
 public:
  explicit AutovmPointerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    const Tensor& x = ctx->input(0);
    out->scalar<int64_t>()() =
        x.TotalBytes() > 0
            ? reinterpret_cast<int64_t>(x.tensor_data().data())
            : 0;
  }
};

// CPU: any dtype, pure identities.
REGISTER_KERNEL_BUILDER(Name("AutovmEvict").Device(DEVICE_CPU),
                        AutovmIdentityOp);
REGISTER_KERNEL_BUILDER(Name("AutovmPrefetch").Device(DEVICE_CPU),
                        AutovmIdentityOp);
REGISTER_KERNEL_BUILDER(Name("AutovmBackwardPrefetch").Device(DEVICE_CPU),
                        AutovmIdentityOp);
REGISTER_KERNEL_BUILDER(Name("AutovmStats").Device(DEVICE_CPU), AutovmStatsOp);
REGISTER_KERNEL_BUILDER(Name("AutovmResetStats").Device(DEVICE_CPU),
                        AutovmResetStatsOp);
REGISTER_KERNEL_BUILDER(Name("AutovmPointer").Device(DEVICE_CPU),
                        AutovmPointerOp);

// GPU: dtypes that live in device memory. Stats and reset have CPU kernels
// only (soft placement puts them there); the pointer comes back in host memory.
#define AUTOVM_REGISTER_GPU(type)                                        \
  REGISTER_KERNEL_BUILDER(                                               \
      Name("AutovmEvict").Device(DEVICE_GPU).TypeConstraint<type>("T"),  \
      AutovmEvictGpuOp);                                                 \
  REGISTER_KERNEL_BUILDER(                                               \
      Name("AutovmPrefetch").Device(DEVICE_GPU).TypeConstraint<type>("T"), \
      AutovmPrefetchGpuOp);                                              \
  REGISTER_KERNEL_BUILDER(Name("AutovmBackwardPrefetch")                 \
                              .Device(DEVICE_GPU)                        \
                              .TypeConstraint<type>("T"),                \
                          AutovmIdentityOp);                             \
  REGISTER_KERNEL_BUILDER(Name("AutovmPointer")                          \
                              .Device(DEVICE_GPU)                        \
                              .TypeConstraint<type>("T")                 \
                              .HostMemory("pointer"),                    \
                          AutovmPointerOp);

TF_CALL_POD_TYPES(AUTOVM_REGISTER_GPU);
#undef AUTOVM_REGISTER_GPU

}  // namespace
}  // namespace tensorflow
