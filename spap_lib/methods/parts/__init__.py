"""The three parts a layer-wise method is composed of: channel selections, width allocations, weight updates."""
