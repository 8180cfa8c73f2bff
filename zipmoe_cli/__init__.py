"""The `zipmoe` command line: one small module per command, no logic of its own."""
