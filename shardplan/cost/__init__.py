"""Cost stage: compute, communication and memory costs of an OpGraph on a Cluster."""
