"""embshard-dist."""

__all__: list[str] = []
