"""Checkpoints of a ``DistributedModelParallel``: save, resume, reshard, export and import.

Import the modules by path; this package imports nothing itself.
"""
