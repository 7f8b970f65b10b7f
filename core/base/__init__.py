"""Errors, JSON and output files, native builds: the bottom layer, importing nothing of npumoe."""
