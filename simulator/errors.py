"""Errors a user can act on.

`InputError` is bad input (exit code 2, one line); an infeasible plan is *not* an error but a
normal result with a reason (see `Result.feasible`).
"""


class InputError(ValueError):
    """Bad input: malformed file, unknown name, impossible degrees. The message is one line."""


def one_line(err: Exception) -> str:
    """A pydantic ValidationError (or any error) as a single readable line."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        msgs = []
        for e in errors():
            loc = ".".join(str(p) if str(p).isprintable() else repr(p) for p in e.get("loc", ()))
            msg = str(e.get("msg", "")).removeprefix("Value error, ")
            msgs.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(msgs)
    return str(err).splitlines()[0] if str(err) else type(err).__name__
