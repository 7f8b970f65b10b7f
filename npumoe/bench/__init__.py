"""`npumoe bench`: one module per benchmark, each with its command and the measurements behind it.

Speed figures live here and in docs/performance.md, never in unit tests.
"""
