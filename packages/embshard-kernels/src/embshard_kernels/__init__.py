"""embshard-kernels."""

__all__: list[str] = []
