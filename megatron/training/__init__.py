"""The training library: the loop, its flags, the model stage, run control and reporting."""
