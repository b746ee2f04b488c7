"""vLLM: weight updates from a trainer into a running vLLM engine (a weight-transfer backend of vLLM's
RL API), and the reload on the engine side that leaves its kernels computing with the new values.
"""
