"""Sharders: turn an unsharded module into its sharded form, and check plans for it (import
modules by path)."""
