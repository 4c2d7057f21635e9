"""The `csbp` command: a thin dispatcher over one module per subcommand.

Subcommand modules are imported lazily so `csbp simulate` never imports torch. Every module
exposes `add_parser(subparsers)` and `run(args) -> int`. Bad input anywhere becomes one line on
stderr and exit code 2; `--json` output is exactly one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pydantic import ValidationError

from simulator.errors import InputError
from simulator.plan import one_line

COMMANDS = {
    "simulate": "simulator.commands.simulate",
    "plan": "simulator.commands.plan",
    "sweep": "simulator.commands.sweep",
    "run": "runtime.launch",
    "calibrate": "runtime.calibrate",
    "validate": "runtime.validate",
    "experiments": "experiments.cli",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage otherwise)
        raise InputError(message)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="csbp", description="Plan, simulate and run block-diffusion LM training "
                     "on long contexts (DP / CP / BP / CSBP with TP, EP, ZeRO).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, module in COMMANDS.items():
        if wanted is not None and name != wanted:
            sub.add_parser(name, help=f"see: csbp {name} --help")
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name and err.name.split(".")[0] == "torch":
                sub.add_parser(name, help="needs torch: pip install 'csbp[runtime]'")
                continue
            if err.name == module:  # not built yet
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            if args.command is None:
                argv = ["plan"]  # the built-in default job
                args = build_parser(argv).parse_args(argv)
            else:
                raise InputError(f"'csbp {args.command}' is unavailable here (is torch installed?)")
        return int(args.func(args) or 0)
    except InputError as err:
        print(f"csbp: error: {err}", file=sys.stderr)
        return 2
    except ValidationError as err:
        print(f"csbp: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("csbp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
