"""One batch for Keras's TensorFlow training function, as `fit` gives it.

A tight plan's first step is measured on a batch taken from `fit`'s
iterator (`first_step.py`), so that it can run again after running out of
memory. Keras's training function runs an iterator through one traced
program and a batch in a list through another; an iterator over that batch
alone with the fit's element spec gets the program the fit runs.
"""

import tensorflow as tf


def next_batch(iterator):
    """The next batch of `fit`'s iterator; `StopIteration` at its end, as
    Keras's training function raises."""
    if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            raise StopIteration
        return optional.get_value()
    return next(iter(iterator))


def batch_for(data, spec):
    """What gives Keras's training function the batch `data` afresh for
    each try: a one-batch iterator with the fit's element `spec`, or, where
    there is none or the batch's structure does not match it, a list,
    which Keras runs as one step through another program."""
    if spec is not None:
        try:
            tf.nest.assert_same_structure(data, spec)
        except (TypeError, ValueError):
            spec = None
    if spec is None:
        return lambda: [data]
    return lambda: one_batch_iterator(data, spec)


def tensor_spec(iterator):
    """The element spec of `fit`'s `iterator` where a one-batch iterator
    can match it (a `tf.data.Iterator` of dense tensors), else `None`."""
    if not isinstance(iterator, tf.data.Iterator):
        return None
    spec = iterator.element_spec
    dense = all(type(s) is tf.TensorSpec for s in tf.nest.flatten(spec))
    return spec if dense else None


def one_batch_iterator(data, spec):
    """An iterator over the one batch `data` whose element spec is `spec`
    (`data`'s shapes relaxed to it): Keras's training function, traced
    for it, is the one traced for the fit's iterator."""
    def relaxed(*element):  # tf.data passes a tuple's items apart.
        return tf.nest.pack_sequence_as(spec, [
            tf.compat.v1.placeholder_with_default(t, s.shape)
            for t, s in zip(tf.nest.flatten(element), tf.nest.flatten(spec))])

    return iter(tf.data.Dataset.from_tensors(data).map(relaxed))
