"""The one exception type for mistakes a user can fix (bad flags, missing files, corrupt data).

Entry points catch it and print a single line (`error: ...`) with a non-zero exit code, no
traceback. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""
