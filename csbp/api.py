"""`csbp.plan(...)` and `csbp.simulate(...)`: the commands as functions, for notebooks.

Keyword arguments become the command's flags and go through the command's own parser, so a value
means (and is refused) exactly as on the command line; no second set of defaults to drift.
"""

from __future__ import annotations

from csbp.simulator.errors import InputError


def _argv(command: str, flags: dict) -> list[str]:
    argv = [command]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            if key in ("from_run",):
                argv += [flag, *map(str, value)]
            elif key == "emit":
                for item in value:
                    argv += [flag, str(item)]
            else:
                argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


def _args(command: str, flags: dict):
    # imported here: `import csbp` must not load the CLI (`python -m csbp.simulator.commands.cli` would
    # then find its own module already imported)
    from csbp.simulator.commands.cli import build_parser

    argv = _argv(command, flags)
    parser = build_parser(argv)
    try:
        return parser.parse_args(argv)
    except SystemExit:  # --help and friends have no meaning here
        raise InputError(f"csbp.{command}: bad arguments {flags!r}") from None


def plan(**flags):
    """Rank every plan for a job (`csbp plan`); returns a `Planned` with `.recommended`,
    `.baseline`, `.speedup`, `.found` (the whole search) and `.to_json()` (`csbp plan --json`).

    e.g. `csbp.plan(model="qwen3.5-27b", seq_len="256k", nodes=2, axes="dp,cp,bp")`."""
    from csbp.simulator.commands.plan import answer

    return answer(_args("plan", flags))


def simulate(**flags):
    """Simulate one plan (`csbp simulate`); returns the `Result` (`.to_json()` is
    `csbp simulate --json`). e.g. `csbp.simulate(plan="dp=2,cp=8,bp=8", seq_len="128k")`."""
    from csbp.simulator.commands.simulate import result_of

    return result_of(_args("simulate", flags))
