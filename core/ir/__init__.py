"""The vocabulary every layer shares: ModelSpec, the graph IR, weights and tensor files, identity, the backend
contract."""
