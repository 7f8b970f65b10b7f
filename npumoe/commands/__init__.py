"""The command-line layer: one module per `npumoe` subcommand (or family of them).

The top layer (docs/architecture.md): it may import every layer below; nothing outside `npumoe.cli` and
this package imports its click-based command modules.
"""
