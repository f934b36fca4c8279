"""The config's error type, in a module of its own so that the schema's helpers (model_checks) raise it without
importing the schema."""


class ConfigError(ValueError):
    """A user error in the configuration. The message names the field, the bad value and the fix."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
