"""The one exception type for a user's mistake: the entry points print it as a single line."""


class UserError(Exception):
    """Bad input (config, data, path, combination of options). The message names what was wrong
    and what to do; entry points print `error: <message>` and exit 2, with no traceback."""
