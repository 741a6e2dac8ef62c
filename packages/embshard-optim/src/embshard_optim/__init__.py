"""embshard-optim."""

__all__: list[str] = []
