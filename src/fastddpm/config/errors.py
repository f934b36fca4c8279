"""The config's error type, in a module of its own so that the schema's helpers (model_checks) raise it without
importing the schema."""


class ConfigError(ValueError):
    """A user error in the configuration. The message names the field, the bad value and the fix."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class Spelling:
    """How an error names an argument, as its reader passed it: `--steps 5` to the user of a command, `steps=5` to
    the user of the Python API (Model.sample, fastddpm.evaluate), whose parameters are the flags' names but for
    these."""

    _API_NAMES = {"class": "class_", "num-images": "n"}

    def __init__(self, *, api: bool = False, names: dict[str, str] | None = None, sets: dict[str, str] | None = None):
        self.api = api
        self.names = names or {}  # arguments a caller takes under other names (see naming)
        self.sets = sets or {}  # arguments a command takes only as `--set SECTION.FIELD=VALUE` (see setting)

    def naming(self, name: str, as_name: str) -> "Spelling":
        """This spelling, for a caller that takes the argument `name` as `as_name`: code shared by `eval` and
        `train` names eval's `inception`, which train takes as `eval-inception`."""
        return Spelling(api=self.api, names={**self.names, name: as_name}, sets=self.sets)

    def setting(self, name: str, key: str) -> "Spelling":
        """This spelling, for a command that takes the argument `name` only as `--set key=VALUE` (bench quality
        takes eval's `inception` as `--set train.eval_inception=PATH`), which its errors then name."""
        return Spelling(api=self.api, names=self.names, sets={**self.sets, name: key})

    def __call__(self, name: str, *value) -> str:
        """`name` as a flag is spelt (`num-images`), with its value when one is given."""
        name, given = self.names.get(name, name), name
        # by the name the code gives or the one the caller takes it as: train's `--set train.eval_inception=PATH` is
        # the `inception` its evaluator names
        for key in (given, name):
            if not self.api and key in self.sets:
                return f"--set {self.sets[key]}" + (f"={value[0]}" if value else "")
        if not self.api:
            return f"--{name}" + (f" {value[0]}" if value else "")
        return self._API_NAMES.get(name, name.replace("-", "_")) + (f"={value[0]!r}" if value else "")


CLI, API = Spelling(), Spelling(api=True)
