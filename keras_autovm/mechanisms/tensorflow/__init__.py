"""Everything TensorFlow-specific: the mechanism (`mechanism`), the explicit
swap with host copies (`swap`), the page-moving custom ops (`ops`), the
managed-memory allocator switch (`managed`) and device facts from the CUDA
driver (`cuda`).

Importing this package imports no TensorFlow; its modules do, except
`managed` and `cuda`, which load it only when called.
"""
