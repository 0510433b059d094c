"""The one exception type for mistakes a user can fix (bad flags, missing files, corrupt data).

Entry points catch it and print a single line (`error: ...`) with a non-zero exit code, no
traceback. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""


class RunFailed(Exception):
    """The run cannot go on for a reason outside the code (it diverged, a peer is gone):
    reported as one line per distinct message, with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
