"""The CPU's part of ``npumoe export``: XNNPACK takes the linears, products and elementwise ops it supports; the
rest (routing, dispatch, the cache writes) runs on ExecuTorch's optimized and portable kernels."""


def partitioners() -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]
