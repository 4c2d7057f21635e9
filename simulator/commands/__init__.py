"""One module per `csbp` subcommand (see simulator/commands/cli.py)."""
