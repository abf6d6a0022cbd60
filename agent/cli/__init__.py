"""``ferry``: the one-shot command line (push, pull, ls, du, verify, retention, ...)."""

from agent.cli.run import main

__all__ = ["main"]
