"""The ``agentmem`` command line (also ``python -m agentmem``): one module per group of commands.

Every command that prints a table takes ``--json``; every failure is one ``error:`` line on
stderr and exit code 1 (2 for usage errors, from Typer), never a traceback. Importing a command
module registers its commands on :data:`app`.
"""

# Imported in the order `agentmem --help` lists their commands: importing a module registers them.
from agentmem.cli import chat, serve, sessions, policies, compact, maintenance  # noqa: F401, I001
from agentmem.cli.common import ERROR_CHARS, app

__all__ = ["ERROR_CHARS", "app"]
