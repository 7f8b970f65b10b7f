"""The CPU's part of ``npumoe export``: XNNPACK takes the linears, products and elementwise ops it supports; the
rest (routing, dispatch, the cache writes) runs on ExecuTorch's optimized and portable kernels."""


def lower(programs: dict, constant_methods: dict):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    return to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()], constant_methods=constant_methods)
