"""Optimizers: the --optimizer suite, main params, sharding, loss scaling, delay mitigation."""
