"""The sequential prune: the sparsity plan, the dense pass, the layer loop and its resumable checkpoints."""
