"""Small shared pieces every layer may use: lazy exports, collectives, calls into DCP, GC control."""
