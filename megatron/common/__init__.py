"""What every layer of the project may use: the errors that end a run with one line
(`errors.py`). Imports nothing of the project."""
