"""The load flow: the planner that maps checkpoint regions to each rank's shards, and ``load_hf_checkpoint``."""
