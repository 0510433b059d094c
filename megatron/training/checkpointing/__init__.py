"""Checkpoints: atomic save and checked load, the torch_dist format, integrity manifests."""
