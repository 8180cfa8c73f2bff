"""`python -m zipmoe_cli` runs the `zipmoe` command (useful where the console script is not on PATH)."""

from zipmoe_cli.app import main

main()
