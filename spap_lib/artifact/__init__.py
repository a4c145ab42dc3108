"""What a run leaves behind: manifests, checkpoints, caches, the ablation grid, figures and tables."""
