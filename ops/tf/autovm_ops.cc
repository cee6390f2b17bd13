// Op registrations of the keras-autovm TensorFlow library (kernels in
// autovm_kernels.cc, Python wrappers and gradients in keras_autovm/tf_ops.py).
//
// The page-moving ops are identities on `data` whose side effect is to move
// the pages of `targets` (CUDA managed memory) to the host or to the GPU on a
// dedicated stream. They are stateful so that graph optimizers neither fold
// nor merge nor prune them: their effect is not in their output.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {

REGISTER_OP("AutovmEvict")
    .Input("data: T")
    .Input("targets: Ttargets")
    .Output("output: T")
    .Attr("T: type")
    .Attr("Ttargets: list(type) >= 0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(R"doc(
Passes `data` through; moves the pages of every tensor in `targets` to the host.

On a GPU the move is a cuMemPrefetchAsync to the host, enqueued on a dedicated
stream (one per device and direction) after the work already on the op's
compute stream (an event orders them); the compute stream never waits for it. Targets that are not CUDA
managed memory are skipped. On the CPU the op is a plain identity.
)doc");

REGISTER_OP("AutovmPrefetch")
    .Input("data: T")
    .Input("targets: Ttargets")
    .Output("output: T")
    .Attr("T: type")
    .Attr("Ttargets: list(type) >= 0")
    .Attr("pre_access: bool = false")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(R"doc(
Passes `data` through; moves the pages of every tensor in `targets` to the GPU
the op runs on, on the dedicated stream. With `pre_access`, the compute stream
then waits for the move, so later readers on it do not fault.
)doc");

REGISTER_OP("AutovmBackwardPrefetch")
    .Input("data: T")
    .Input("targets: Ttargets")
    .Output("output: T")
    .Attr("T: type")
    .Attr("Ttargets: list(type) >= 0")
    .Attr("pre_access: bool = false")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(R"doc(
Identity on `data` (no page movement). Its registered gradient is
AutovmPrefetch(grad, targets): the prefetch is issued when the gradient of
`data` is computed in the backward pass.
)doc");

REGISTER_OP("AutovmStats")
    .Output("stats: int64")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(5));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Process-wide counters of the page-moving GPU kernels: [ops_issued,
bytes_evicted, bytes_prefetched, tensors_skipped, errors].
)doc");

REGISTER_OP("AutovmResetStats")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Sets the AutovmStats counters to zero.");

REGISTER_OP("AutovmPointer")
    .Input("x: T")
    .Output("pointer: int64")
    .Attr("T: type")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
The address of `x`'s buffer (a device address for a tensor on a GPU), as a
host int64. For tests and diagnostics.
)doc");

}  // namespace tensorflow
