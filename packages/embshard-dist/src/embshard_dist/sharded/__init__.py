"""Sharded modules: the model-parallel forms of embshard's collections (import modules by path)."""
