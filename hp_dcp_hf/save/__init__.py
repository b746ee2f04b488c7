"""The save flow: the planner that maps each rank's shards back to checkpoint files, and ``save_hf_checkpoint``."""
