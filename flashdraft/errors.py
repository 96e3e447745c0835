"""The one exception type users catch: bad input, bad files, bad combinations."""


class FlashdraftError(ValueError):
    """A user-facing error whose message names the problem and the fix in one line."""
