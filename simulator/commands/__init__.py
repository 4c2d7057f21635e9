"""One module per `csbp` subcommand (see simulator/cli.py)."""
