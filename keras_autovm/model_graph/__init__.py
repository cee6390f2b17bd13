"""A Keras model read as the planner's `Graph`.

`walk` follows the model's calls in run order and names its tensors;
`layer_facts` knows what each layer's backward pass reads, its FLOPs and
byte sizes. Neither changes the model.
"""

from keras_autovm.model_graph.layer_facts import backward_reads
from keras_autovm.model_graph.layer_facts import optimizer_state_bytes
from keras_autovm.model_graph.walk import build_graph
from keras_autovm.model_graph.walk import call_names
from keras_autovm.model_graph.walk import functional_of
from keras_autovm.model_graph.shapes import input_shapes_of
from keras_autovm.model_graph.walk import layer_calls
from keras_autovm.model_graph.shapes import needs_input_shapes
from keras_autovm.model_graph.walk import op_name
from keras_autovm.model_graph.walk import tag_names

__all__ = ["backward_reads", "build_graph", "call_names", "functional_of",
           "input_shapes_of", "layer_calls",
           "needs_input_shapes", "op_name", "optimizer_state_bytes", "tag_names"]
