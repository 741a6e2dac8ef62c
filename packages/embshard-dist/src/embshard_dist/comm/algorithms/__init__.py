"""The backend- and device-specific algorithms behind comm's collectives, one function each.

A collective never picks one itself: :mod:`embshard_dist.comm.dispatch` does. Every variant of
an op computes the same result, bit for bit.
"""

__all__: list[str] = []
