"""Parallelize passes: each file holds one pass, each pass is a function."""
