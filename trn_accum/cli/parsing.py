"""What every `trn-accum` subcommand shares: the program name, the parser whose errors are one
line (`UsageError`, exit 2), and the --config / --set pair."""

from __future__ import annotations

import argparse

from trn_accum.errors import UserError

PROG = "trn-accum"


class UsageError(UserError):
    """A bad command-line value: one line naming the value, the rule and a fix."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: no usage block, a pointer to --help."""

    def error(self, message):  # one line, no usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def config_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--config", required=True, metavar="FILE", help="TOML config file")
    sp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="overrides",
        help="override a config value (repeatable), e.g. --set trainer.steps=20",
    )
