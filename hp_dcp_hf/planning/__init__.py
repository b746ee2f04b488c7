"""What the load and the save planners share: the composition both trace (the load run forwards
or inverted), one target per tied group, and the checks that a traced tensor fits the model's."""
