"""Sharding strategies and the layout arithmetic they share (import modules by path)."""
