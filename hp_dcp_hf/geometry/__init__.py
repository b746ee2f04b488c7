"""Where tensors lie: boxes of elements, the local shards of a DTensor, and replica groups."""
