"""embshard-types."""

__all__: list[str] = []
