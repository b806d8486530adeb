"""The one error type a user's mistake raises; the CLI prints its message as one line and exits."""


class UserError(Exception):
    """A problem with the user's input (a path, a name, an option). `exit_code` is what the CLI returns."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
