"""``shardplan train``: the pieces of a training run (checkpoints, ...) around a planned step."""
