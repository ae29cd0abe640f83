"""The one exception type for user mistakes: one sentence naming the bad input and the fix, printed by the CLI
without a traceback (anything else escaping is a bug and keeps its traceback).
"""

LINE_BREAKS = str.maketrans({char: repr(char)[1:-1] for char in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


class KvprofError(Exception):
    """A user-facing error: `str(err)` is the whole one-line message (quoted line breaks shown escaped)."""

    def __init__(self, message: str):
        super().__init__(message.translate(LINE_BREAKS))
