"""Small models of every kind a Keras user brings, for tests/test_model_zoo.py.

Each entry builds a model and its data: `(model, x, y, loss)`.
"""

import keras
import numpy as np

L = keras.layers


def _images(n=16, size=12, seed=0):
    return np.random.default_rng(seed).normal(size=(n, size, size, 3)).astype("float32")


def _targets(n, width, seed=1):
    return np.random.default_rng(seed).normal(size=(n, width)).astype("float32")


def cnn_bn_dropout():
    model = keras.Sequential([
        keras.Input((12, 12, 3)),
        L.Conv2D(8, 3, padding="same", name="c1"),
        L.BatchNormalization(name="bn1"),
        L.ReLU(name="r1"),
        L.Dropout(0.3, name="drop"),
        L.Conv2D(8, 3, padding="same", activation="relu", name="c2"),
        L.Conv2D(8, 3, padding="same", name="c3"),
        L.BatchNormalization(name="bn3"),
        L.ReLU(name="r3"),
        L.GlobalAveragePooling2D(name="gap"),
        L.Dense(4, name="head"),
    ], name="cnn_bn_dropout")
    return model, _images(), _targets(16, 4), "mse"


def shared_layer():
    inputs = keras.Input((10,))
    x = L.Dense(16, activation="tanh", name="d0")(inputs)
    x = L.Dense(16, activation="tanh", name="d1")(x)
    shared = L.Dense(16, activation="tanh", name="shared")
    x = shared(x)
    x = L.Dense(16, activation="tanh", name="d2")(x)
    x = shared(x)
    outputs = L.Dense(4, name="head")(x)
    x_data = np.random.default_rng(0).normal(size=(16, 10)).astype("float32")
    return keras.Model(inputs, outputs, name="shared_layer"), x_data, _targets(16, 4), "mse"


def nested():
    inner_in = keras.Input((12, 12, 8))
    y = L.Conv2D(8, 3, padding="same", name="ic1")(inner_in)
    y = L.BatchNormalization(name="ibn")(y)
    y = L.ReLU(name="ir")(y)
    inner = keras.Model(inner_in, L.Conv2D(8, 3, padding="same", name="ic2")(y), name="inner")
    inputs = keras.Input((12, 12, 3))
    x = L.Conv2D(8, 3, padding="same", name="stem")(inputs)
    x = inner(x)
    x = L.ReLU(name="r")(x)
    x = L.Conv2D(8, 3, padding="same", name="c")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    outputs = L.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs, name="nested"), _images(), _targets(16, 4), "mse"


def multi_io():
    image = keras.Input((12, 12, 3), name="image")
    meta = keras.Input((5,), name="meta")
    x = L.Conv2D(8, 3, padding="same", activation="relu", name="c1")(image)
    x = L.Conv2D(8, 3, padding="same", activation="relu", name="c2")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    m = L.Dense(8, activation="relu", name="m1")(meta)
    x = L.Concatenate(name="cat")([x, m])
    x = L.Dense(16, activation="relu", name="d1")(x)
    out_a = L.Dense(4, name="out_a")(x)
    out_b = L.Dense(2, name="out_b")(x)
    model = keras.Model([image, meta], [out_a, out_b], name="multi_io")
    x_data = [_images(), np.random.default_rng(2).normal(size=(16, 5)).astype("float32")]
    return model, x_data, [_targets(16, 4), _targets(16, 2, seed=3)], ["mse", "mse"]


def recurrent():
    inputs = keras.Input((8, 6))
    x = L.LSTM(12, return_sequences=True, name="lstm")(inputs)
    x = L.GRU(12, return_sequences=True, name="gru")(x)
    x = L.LayerNormalization(name="ln")(x)
    x = L.GlobalAveragePooling1D(name="pool")(x)
    outputs = L.Dense(4, name="head")(x)
    x_data = np.random.default_rng(0).normal(size=(16, 8, 6)).astype("float32")
    return keras.Model(inputs, outputs, name="recurrent"), x_data, _targets(16, 4), "mse"


def attention():
    inputs = keras.Input((8, 16))
    a = L.MultiHeadAttention(2, 8, name="mha")(inputs, inputs)
    x = L.Add(name="add1")([inputs, a])
    x = L.LayerNormalization(name="ln1")(x)
    f = L.Dense(32, activation="gelu", name="ff1")(x)
    f = L.Dense(16, name="ff2")(f)
    x = L.LayerNormalization(name="ln2")(L.Add(name="add2")([x, f]))
    x = L.GlobalAveragePooling1D(name="pool")(x)
    outputs = L.Dense(4, name="head")(x)
    x_data = np.random.default_rng(0).normal(size=(16, 8, 16)).astype("float32")
    return keras.Model(inputs, outputs, name="attention"), x_data, _targets(16, 4), "mse"


@keras.saving.register_keras_serializable(package="autovm_tests")
class PositionEmbedding(L.Layer):
    """Adds a learned embedding per position, for any length up to the most."""

    def __init__(self, sequence_length, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = sequence_length

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.sequence_length, input_shape[-1]), name="embeddings")

    def call(self, x):
        length = keras.ops.shape(x)[1]
        return x + keras.ops.expand_dims(self.embeddings[:length], 0)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return dict(super().get_config(), sequence_length=self.sequence_length)


@keras.saving.register_keras_serializable(package="autovm_tests")
class TinyBackbone(keras.Model):
    """A keras-hub style backbone: a functional model made from a config
    (token and position embeddings, then transformer blocks), taking token
    ids of any length."""

    def __init__(self, vocabulary_size, hidden_dim, num_layers, num_heads,
                 intermediate_dim, max_sequence_length, dropout=0.1, **kwargs):
        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        x = L.Embedding(vocabulary_size, hidden_dim, name="token_embedding")(token_ids)
        x = PositionEmbedding(max_sequence_length, name="position_embedding")(x)
        x = L.LayerNormalization(name="embeddings_norm")(x)
        x = L.Dropout(dropout, name="embeddings_dropout")(x)
        for i in range(num_layers):
            a = L.MultiHeadAttention(num_heads, hidden_dim // num_heads,
                                     dropout=dropout, name=f"block{i}_attention")(x, x)
            a = L.Dropout(dropout, name=f"block{i}_attention_dropout")(a)
            x = L.LayerNormalization(name=f"block{i}_attention_norm")(
                L.Add(name=f"block{i}_attention_add")([x, a]))
            f = L.Dense(intermediate_dim, activation="gelu", name=f"block{i}_ff1")(x)
            f = L.Dense(hidden_dim, name=f"block{i}_ff2")(f)
            f = L.Dropout(dropout, name=f"block{i}_ff_dropout")(f)
            x = L.LayerNormalization(name=f"block{i}_ff_norm")(
                L.Add(name=f"block{i}_ff_add")([x, f]))
        super().__init__(inputs=token_ids, outputs=x, **kwargs)
        self.settings = dict(
            vocabulary_size=vocabulary_size, hidden_dim=hidden_dim,
            num_layers=num_layers, num_heads=num_heads,
            intermediate_dim=intermediate_dim,
            max_sequence_length=max_sequence_length, dropout=dropout)

    def get_config(self):
        return dict(self.settings, name=self.name)

    @classmethod
    def from_config(cls, config):
        return cls(**config)


BACKBONE_CONFIG = dict(vocabulary_size=50, hidden_dim=16, num_layers=2, num_heads=2,
                       intermediate_dim=32, max_sequence_length=32, dropout=0.1)


def backbone():
    model = TinyBackbone.from_config(dict(BACKBONE_CONFIG, name="tiny_backbone"))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(16, 10)).astype("int32")
    return model, tokens, rng.normal(size=(16, 10, 16)).astype("float32"), "mse"


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = L.Conv2D(8, 3, padding="same", activation="relu")
        self.pool = L.GlobalAveragePooling2D()
        self.head = L.Dense(4)

    def call(self, x):
        return self.head(self.pool(self.conv(x)))


def subclassed():
    return Subclassed(name="subclassed"), _images(), _targets(16, 4), "mse"


def mixed_precision():
    """To build and train under `keras.config.set_dtype_policy(MIXED)`;
    the head computes in float32, as Keras's guide advises."""
    model = keras.Sequential([
        keras.Input((12, 12, 3)),
        L.Conv2D(8, 3, padding="same", name="c1"),
        L.BatchNormalization(name="bn1"),
        L.ReLU(name="r1"),
        L.Conv2D(8, 3, padding="same", activation="relu", name="c2"),
        L.GlobalAveragePooling2D(name="gap"),
        L.Dense(4, name="d"),
        L.Dense(4, dtype="float32", name="head"),
        L.Activation("linear", dtype="float32", name="out"),
    ], name="mixed_precision")
    return model, _images(), _targets(16, 4), "mse"


# bfloat16: float16 lacks CPU kernels on some backends.
MIXED = "mixed_bfloat16"


ZOO = {fn.__name__: fn for fn in (
    cnn_bn_dropout, shared_layer, nested, multi_io, recurrent, attention,
    backbone, subclassed, mixed_precision)}
