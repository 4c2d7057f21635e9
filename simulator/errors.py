"""Errors a user can act on.

`InputError` is bad input (exit code 2, one line); an infeasible plan is *not* an error but a
normal result with a reason (see `Result.feasible`).
"""


class InputError(ValueError):
    """Bad input: malformed file, unknown name, impossible degrees. The message is one line."""
