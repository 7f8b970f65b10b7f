"""What ``npumoe export``'s ExecuTorch partitioners share: each connected run of the nodes a backend takes becomes a
delegated partition of its own."""

from __future__ import annotations


def tag_partitions(edge_program, support, delegation_spec):
    """ExecuTorch's ``PartitionResult`` for ``edge_program`` with every connected run of nodes that ``support`` (an
    ``OperatorSupportBase``) takes tagged as one partition (single nodes too), and the constants they read."""
    from executorch.exir.backend.partitioner import PartitionResult
    from executorch.exir.backend.utils import tag_constant_data
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

    tags = {}
    for part in CapabilityBasedPartitioner(edge_program.graph_module, support,
                                           allows_single_node_partition=True).propose_partitions():
        for node in part.nodes:
            node.meta["delegation_tag"] = f"tag{part.id}"
        tags[f"tag{part.id}"] = delegation_spec
    tag_constant_data(edge_program)
    return PartitionResult(tagged_exported_program=edge_program, partition_tags=tags)
