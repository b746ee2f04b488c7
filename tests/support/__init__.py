"""What the tests share: tiny models and checkpoints, layouts, reference loads, and real servers."""
