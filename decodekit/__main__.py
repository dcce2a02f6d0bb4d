"""`python -m decodekit` runs the CLI."""

from decodekit.cli import main

main()
