"""The command-line layer: one module per `npumoe` subcommand (or family of them).

Everything here may import every other layer (models → core → backends → commands); nothing
outside `npumoe.cli` and this package imports click-based command modules.
"""
