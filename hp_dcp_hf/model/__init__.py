"""The model as transformers builds it: config and class, the meta skeleton, its dtype, and its finalization after a load."""
