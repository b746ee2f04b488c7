"""Weights from a trainer straight into an inference engine: Hugging Face names, each rank sending
the bytes it holds, each engine worker receiving the slices it consumes (``docs/sync.md``)."""
