"""Cluster state in Redis: the node registry, load, block-hash index, the routing read."""
