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

from csbp.simulator.errors import InputError, one_line

COMMANDS = {  # name -> (module, one-line help shown by `csbp --help`)
    "plan": ("csbp.simulator.commands.plan", "rank every plan for a model, context and cluster (default)"),
    "simulate": ("csbp.simulator.commands.simulate", "predict step time, tokens/s and memory of one plan"),
    "sweep": ("csbp.simulator.commands.sweep", "plan over lists of contexts, models and GPU counts"),
    "map": ("csbp.simulator.commands.map", "decision map: winning plan family and BP speedup per context x GPUs"),
    "run": ("csbp.runtime.training.launch", "run a plan for real on this host (gloo on CPU, NCCL on GPU)"),
    "calibrate": ("csbp.runtime.calibration.calibrate", "measure this host into a hardware profile"),
    "validate": ("csbp.runtime.validation.validate", "compare predictions with runtime measurements"),
    "experiments": ("csbp.experiments.cli", "regenerate the CSBP studies (tables and plots)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage otherwise)
        raise InputError(message)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="csbp", description="Plan, simulate and run block-diffusion LM training "
                     "on long contexts (DP / CP / BP / CSBP with TP, EP, ZeRO).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module, text) in COMMANDS.items():
        if name != wanted:  # only the command being run is imported (torch stays unloaded)
            sub.add_parser(name, help=text, add_help=False)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name and err.name.split(".")[0] == "torch":
                raise InputError(f"'csbp {name}' needs torch: pip install torch==2.13.0 "
                                 "(or the 'runtime' extra)") from None
            raise
        mod.add_parser(sub)
    return parser


def _error(message: str) -> int:
    """Bad input: one line on stderr (line breaks in names or values from files included)."""
    print(f"csbp: error: {' '.join(message.splitlines())}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
            argv = ["plan", *argv]  # the built-in default job
        args = build_parser(argv).parse_args(argv)
        return int(args.func(args) or 0)
    except InputError as err:
        return _error(str(err))
    except ValidationError as err:
        return _error(one_line(err))
    except KeyboardInterrupt:
        print("csbp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
