"""The one exception type for user mistakes.

A `KvprofError` carries one sentence that names the bad input and the fix. The CLI prints it and exits
non-zero without a traceback; anything else that escapes is a bug in kvprof and keeps its traceback.
"""


class KvprofError(Exception):
    """A user-facing error: `str(err)` is the whole message shown to the user."""
