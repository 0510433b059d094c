"""Experiment tracking outside this process's log: Weights & Biases (wandb_run.py)."""
