"""`python -m rlsys.cli` is the same as the `rlsys` command."""

from rlsys.cli.main import main

main()
