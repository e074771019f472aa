"""`python -m tokenmill.jobs.cli` (the CLI's own re-exec uses it)."""

from tokenmill.jobs.cli import cli_entry

cli_entry()
