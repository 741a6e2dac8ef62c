"""Sharding strategies of embedding collections, one module per strategy, pooled and sequence
side by side; each runs a step as input dist -> lookup -> output dist. Import modules by path.
"""
