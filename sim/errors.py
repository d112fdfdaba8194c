"""Errors raised for bad input, naming the field (and file/line where there is one)."""


class ConfigError(ValueError):
    """A configuration value is invalid. The message starts with the dotted field name."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def require(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(field, message)
