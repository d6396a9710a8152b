"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class MlaconvError(Exception):
    """A problem with the user's input or environment, explained in one line.

    The CLI prints ``error: <message>`` and exits with status 1; anything else that escapes is a bug
    (reported as such, with the traceback under ``--debug``).
    """


class MlaconvWarning(UserWarning):
    """Something the user should know that does not stop the run; the CLI prints it as one ``warning:`` line."""
