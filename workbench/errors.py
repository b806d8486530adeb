"""The one error type a user's mistake raises; the CLI prints its message as one line and exits."""


class UserError(Exception):
    """A problem with the user's input (a path, a name, an option). `exit_code` is what the CLI returns."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) that a command handled: what had finished is written, and the message says
    where. Still a KeyboardInterrupt for callers; the CLI prints the message and exits 130."""


def yaml_error_text(exc: Exception) -> str:
    """' (line N): problem' for a yaml.YAMLError, on one line, to follow 'malformed YAML' in a UserError."""
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1})" if mark is not None else ""
    return f"{where}: {getattr(exc, 'problem', None) or exc}".replace("\n", " ")
