"""The one exception type for user mistakes.

A `KvprofError` carries one sentence that names the bad input and the fix. The CLI prints it and exits
non-zero without a traceback; anything else that escapes is a bug in kvprof and keeps its traceback.
"""

LINE_BREAKS = str.maketrans({char: repr(char)[1:-1] for char in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


class KvprofError(Exception):
    """A user-facing error: `str(err)` is the whole message shown to the user, on one line (line breaks in what it
    quotes from a file are shown escaped)."""

    def __init__(self, message: str):
        super().__init__(message.translate(LINE_BREAKS))
