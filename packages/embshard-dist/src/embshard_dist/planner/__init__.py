"""Sharding planners: decide how every table of a model is split across ranks and placed.

Import the modules by path; this package imports nothing itself.
"""
