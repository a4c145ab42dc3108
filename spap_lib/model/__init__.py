"""The model: resolving a name to weights, loading, per-architecture adapters, offloading, running layers."""
