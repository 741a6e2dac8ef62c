"""Distributed primitives every sharded module is built from: the bottom layer of embshard_dist.

Import the modules by path; this package imports nothing itself, so importing it is free.
"""
