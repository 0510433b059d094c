"""The one exception type for mistakes a user can fix (bad flags, missing files, corrupt data).

Entry points catch it and print a single line (`error: ...`) with a non-zero exit code, no
traceback (`run_tool` for the command lines in tools/). Everything else is a bug and keeps its
traceback.
"""

import sys


class UserError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""


class RunFailed(Exception):
    """The run cannot go on for a reason outside the code (it diverged, a peer is gone):
    reported as one line per distinct message, with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def run_tool(main, *args) -> int:
    """A command line's exit code: `main(*args)`'s, or 2 after one `error: ...` line on stderr
    when the user's input is the problem."""
    try:
        return main(*args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
