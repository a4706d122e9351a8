"""``UserError``: a mistake the user can fix, raised anywhere and printed by the CLI as one ``error:`` line
(exit code 2). It sits on the ground floor so that every package raises the same class."""


class UserError(Exception):
    """A mistake the user can fix; the CLI prints it as one line and exits with code 2."""
