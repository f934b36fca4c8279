"""A run's config from its layers, one resolver for the command line and the Python API:

    a preset (or a resumed checkpoint's config)  <  a YAML/JSON config file  <  each layer of overrides, in order

Values from files, flags and keyword arguments are coerced to each field's declared type, naming the field on
error; unknown fields are named with the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Iterable

from fastddpm.config.errors import API, CLI, Spelling
from fastddpm.config.model_checks import FAMILY_ONLY
from fastddpm.config.presets import PRESETS, get_preset
from fastddpm.config.schema import SECTIONS, ConfigError, RunConfig


def positive_int(text: str) -> int:
    """argparse type for counts given on the command line (data, bench, eval): a positive integer or a clear error."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Turn a JSON/YAML/CLI value into the field's declared type, or raise a ConfigError naming `where`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
            return None
        options = [a for a in args if a is not type(None)]
        for option in options[:-1]:  # e.g. int | str: an int if it parses, else the string
            try:
                return coerce(value, option, where)
            except ConfigError:
                pass
        return coerce(value, options[-1], where)
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}={value!r}: expected a comma-separated list")
        elem = args[0]
        return tuple(coerce(v.strip() if isinstance(v, str) else v, elem, where) for v in items)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            if isinstance(value, str):
                value = value.replace("_", "")
                return int(float(value)) if ("e" in value.lower() and float(value).is_integer()) else int(value)
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={value!r} is not a valid {getattr(tp, '__name__', tp)}") from None
    return value


def _field_of_flag(key: str) -> tuple[str, str] | None:
    """(section, field) of a field whose flag is spelt `key` (eval_every: --eval-every sets train.eval_every_images),
    or None."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") and f.metadata["cli"].replace("-", "_") == key.replace("-", "_"):
                return section, f.name
    return None


def _unknown_key(section: str, key: str, valid) -> ConfigError:
    flag = _field_of_flag(key)
    hint = [flag[1]] if flag and flag[0] == section else difflib.get_close_matches(key, list(valid), n=1)
    return ConfigError(
        f"unknown config field {section}.{key}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        + f"; valid fields: {', '.join(valid)}"
    )


def _unknown_section(source: str, key: str) -> ConfigError:
    """A top-level key that is no section: most often a field written without its section (`lr: 3e-4` at the top
    of a config file), else a misspelt section."""
    name = key.replace("-", "_")
    owners = [sec for sec, cls in SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)}]
    if len(owners) == 1:
        hint = f"it is a field of {owners[0]}: put it under `{owners[0]}:` (or write {owners[0]}.{name})"
    elif owners:
        hint = f"it is a field of {' and '.join(owners)}: put it under one of them"
    else:
        close = difflib.get_close_matches(key, ["preset", *SECTIONS], n=1)
        hint = (f"did you mean {close[0]!r}? " if close else "") + "a config holds preset and the sections " \
            + ", ".join(SECTIONS)
    return ConfigError(f"{source}: {key!r} is no config section: {hint}")


# YAML 1.1 (PyYAML) reads unquoted on/off/yes/no as booleans, so `compile: off` arrives as False
_ON_OFF = {True: "on", False: "off"}


def apply_overrides(cfg: RunConfig, overrides: dict[str, Any], source: str = "config") -> RunConfig:
    """Return a new RunConfig with {section: {field: value}} (or {"section.field": value}) applied and validated."""
    nested: dict[str, dict[str, Any]] = {}
    preset = cfg.preset
    for key, value in overrides.items():
        if key == "preset":
            preset = value
            continue
        if "." in key:
            sec, name = key.split(".", 1)
            nested.setdefault(sec, {})[name] = value
        elif key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: section {key!r} must be a mapping of field: value")
            nested.setdefault(key, {}).update(value)
        else:
            raise _unknown_section(source, key)
    sections = {}
    for sec, cls in SECTIONS.items():
        current = dataclasses.asdict(getattr(cfg, sec))
        types = field_types(cls)
        for name, value in nested.pop(sec, {}).items():
            name = name.replace("-", "_")
            if name not in types:
                raise _unknown_key(sec, name, types)
            choices = cls.__dataclass_fields__[name].metadata.get("choices") or ()
            if isinstance(value, bool) and types[name] is not bool and _ON_OFF[value] in choices:
                value = _ON_OFF[value]
            current[name] = coerce(value, types[name], f"{sec}.{name}")
        sections[sec] = cls(**current)
    if nested:
        raise _unknown_section(source, next(iter(nested)))
    return RunConfig(preset=preset, **sections)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (sections model/diffusion/data/train, optional preset)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" + (" (it is a folder)" if path.is_dir() else ""))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # a binary file, or text saved in another encoding
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}): save it as UTF-8 YAML or "
                          "JSON") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or e}): check its permissions") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(path, pairs))
        else:
            import yaml

            data = yaml.load(text, Loader=_unique_keys_yaml_loader(path))  # noqa: S506 - a SafeLoader subclass
    except ConfigError:
        raise
    except Exception as e:  # the parser's own message says where
        raise ConfigError(f"could not parse config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping (sections model/diffusion/data/train)")
    _check_paths_found_from_here(path, data)
    return data


def _unique_keys(path: Path, pairs: list[tuple[Any, Any]], lines: list[int] | None = None) -> dict:
    """A mapping of a config file whose keys are all distinct. YAML and JSON parsers keep the last of a key written
    twice (two `train:` sections), dropping every field the first one set without a word."""
    seen: dict[Any, int] = {}
    for i, (key, _) in enumerate(pairs):
        if key in seen:
            where = f" (lines {seen[key]} and {lines[i]})" if lines else ""
            raise ConfigError(f"config file {path}: {key!r} is written twice in one mapping{where}, and only the "
                              f"last would count: merge them into one {key!r}")
        seen[key] = lines[i] if lines else i
    return dict(pairs)


def _unique_keys_yaml_loader(path: Path):
    """yaml.SafeLoader whose mappings refuse a key written twice (see _unique_keys)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):  # the keys written here: a merge key's (<<) may be overridden
                written = [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
                keys = [self.construct_object(k, deep=deep) for k in written]
                if all(isinstance(key, (str, int, float, bool, type(None))) for key in keys):
                    _unique_keys(path, [(key, None) for key in keys], [k.start_mark.line + 1 for k in written])
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


# Config fields that name a file or folder: a relative one is read from the working directory, as on the command line
_PATH_FIELDS = (("data", "source"), ("train", "init_from"))


def _check_paths_found_from_here(path: Path, data: dict) -> None:
    """A relative path in a config file is read from the working directory (as the same path typed as a flag is).
    Written relative to the file's own folder instead, it names nothing from here: refused naming both readings,
    before a data name or a download is tried under it."""
    for section, name in _PATH_FIELDS:
        value = data.get(section, {}).get(name) if isinstance(data.get(section), dict) else None
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            continue
        here, beside = Path(value).expanduser(), path.parent / Path(value).expanduser()
        if not here.exists() and beside.exists() and path.parent.resolve() != Path.cwd().resolve():
            raise ConfigError(f"config file {path}: {section}.{name}={value!r} is read from the working directory "
                              f"({Path.cwd()}), where it does not exist; beside the config file it is {beside}: write "
                              f"that path (or an absolute one) in the file, or run from {path.parent}")


def from_dict(d: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from its to_dict() form (e.g. a checkpoint's config)."""
    return apply_overrides(RunConfig(preset=d.get("preset")),
                           {k: v for k, v in d.items() if k != "preset"}, source="checkpoint config")


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


# A run has one length: a layer that sets one of these clears the others it does not set (a preset's max_images
# gives way to --max-steps, or to max_steps= from Python).
RUN_LENGTHS = ("max_steps", "max_images", "max_epochs")


def qualify(key: str, source: str) -> str:
    """"section.field" for a key given as a bare field name of exactly one section (max_images ->
    train.max_images), the field's hyphens made underscores as the flags spell them (train.max-images ->
    train.max_images): the run-length reset and the objective check look the keys up by their field names. A
    ConfigError names the closest field otherwise."""
    if "." in key:
        section, name = key.split(".", 1)
        return f"{section}.{name.replace('-', '_')}"
    key = key.replace("-", "_")
    fields = {sec: {f.name for f in dataclasses.fields(cls)} for sec, cls in SECTIONS.items()}
    owners = [sec for sec, names in fields.items() if key in names]
    if not owners:
        known = {name: sec for sec, names in fields.items() for name in names}
        flag = _field_of_flag(key)
        close = [flag[1]] if flag else difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]} ({known[close[0]]}.{close[0]})?" if close else \
            "docs/config.md lists every field"
        raise ConfigError(f"{source}: {key!r} is in no config section: {hint}")
    if len(owners) > 1:
        raise ConfigError(f"{source}: {key} is a field of {' and '.join(owners)}: name it as section.field, e.g. "
                          f"{owners[0]}.{key}")
    return f"{owners[0]}.{key}"


def resolve_config(base: RunConfig | str | dict | None = None, *, file: str | Path | None = None,
                   layers: Iterable[tuple[str, dict[str, Any]]] = (), resumed: RunConfig | None = None
                   ) -> RunConfig:
    """A run's config from its layers, later ones winning: `base` (a RunConfig, its dict form as config.json
    holds it, over the preset the dict names, or a preset's name; None: the config file's own `preset`, else the
    defaults) < the config `file` (YAML or JSON) < each (source, {key: value}) of `layers`, in order, where a key
    is "section.field" or a field name of one section, and `source` names the layer in errors (e.g. "--set",
    "command line", "fastddpm.train").

    When the file, a layer or `base` sets train.init_from (a diffusers UNet2DModel or DDPMPipeline folder), the
    folder's architecture and schedule (config.diffusers_unet.folder_fields) are a layer right above `base`:
    what the file and the layers set explicitly wins, and a value that changes the network's function is refused
    when the weights load. `resumed`: the config of the checkpoint being resumed, whose model and diffusion take
    the folder's place (they were read from it when the run started; the folder may be gone)."""
    data = load_config_file(file) if file is not None else {}
    if base is None and data.get("preset"):
        base = data["preset"]
    base_values = base if isinstance(base, dict) else {}
    if isinstance(base, dict):  # over the preset it names, as a config file's values are
        cfg = apply_overrides(_preset_of(base), _file_length_replaces("config dict", base), source="config dict")
    else:
        cfg = get_preset(base) if isinstance(base, str) else (base if base is not None else RunConfig())
    layers = [(source, {qualify(k, source): v for k, v in values.items()}) for source, values in layers]
    file_values = _file_length_replaces(file, {k: v for k, v in data.items() if k != "preset"})
    folder = _init_from(cfg, file_values, layers)
    if folder and resumed is not None:
        cfg = _layered(cfg, [(f"the resumed run (started from {folder})",
                              {f"{sec}.{k}": v for sec in ("model", "diffusion")
                               for k, v in dataclasses.asdict(getattr(resumed, sec)).items()})])
    elif folder:
        from fastddpm.config.diffusers_unet import folder_fields

        family = _last_given(file_values, layers, "model", "family")
        if family not in (None, "ddpm"):
            # named as the caller gave it: the command's flag, or fastddpm.train's keyword
            said = _said(next((source for source, values in reversed(layers) if "model.family" in values), ""))
            raise ConfigError(f"{said('init-from', folder)}: a diffusers UNet2DModel is fastddpm's ddpm family (Ho et "
                              f"al.'s U-Net), so model.family={family!r} cannot take its weights: drop "
                              f"{said('family', family)} (the folder sets the architecture)")
        fields = folder_fields(folder)
        if not fields["model.conditional"]:
            # a model without a class embedding drops no labels: its config records none, not the label dropout
            # of a class-conditional preset under it (cpu-demo-cond, the CPU's default), which it never reads
            fields["train.cond_drop_prob"] = 0.0
        if _last_given(base_values, [], "model", "dropout", default=_NOT_GIVEN) is not _NOT_GIVEN:
            fields.pop("model.dropout", None)  # a config dict's own dropout: the run's choice, not the folder's
        cfg = _layered(cfg, [(f"--init-from {folder}", fields)])
    try:
        cfg = apply_overrides(cfg, file_values, source=str(file))
    except ConfigError as e:  # a field's or a value's error names the file it is in
        raise (e if str(e).startswith(str(file)) else ConfigError(f"config file {file}: {e}")) from None
    cfg = _layered(cfg, layers)
    _refuse_other_objectives(cfg, layers)
    _refuse_unread_betas(cfg, layers)
    _refuse_other_families(cfg, layers)
    _refuse_conditional_only(cfg, layers, [("config dict", base_values), (f"config file {file}", file_values)])
    return cfg


def _preset_of(values: dict) -> RunConfig:
    """The preset a config dict names, what its values go over: the defaults where it names none, or where it is
    a whole saved config (every section) of a preset this version no longer has."""
    if not values.get("preset"):
        return RunConfig()
    try:
        return get_preset(values["preset"])
    except ConfigError:
        if set(SECTIONS) <= set(values):
            return RunConfig()
        raise


# the train fields that only a class-conditional model reads
_CONDITIONAL_ONLY = ("cond_drop_prob", "sample_guidance")


def _refuse_conditional_only(cfg: RunConfig, layers: list[tuple[str, dict[str, Any]]],
                             files: list[tuple[str, dict[str, Any]]] = ()) -> None:
    """Label dropout, the guidance scale and class names given explicitly to an unconditional run would be ignored
    without a word: `--cond-drop-prob 0.2` without `--conditional` trains an unconditional model, likely not what
    was meant.
    Given by a layer, or by one of `files`: (source, values nested by section or dotted), a config file's or
    the Python API's config dict. The default (what a saved config.json holds) and 0 (no label dropout, no
    guidance: what an unconditional model does anyway, as a sweep's unconditional baseline may spell it) are no
    setting."""
    if cfg.model.conditional:
        return
    defaults = RunConfig().train
    given = list(layers)
    for source, file_values in files:
        # spelt with hyphens too (cond-drop-prob), as apply_overrides reads them
        spelt = {k.replace("-", "_"): ({n.replace("-", "_"): v for n, v in value.items()} if isinstance(value, dict)
                                       else value) for k, value in file_values.items()}
        found = {f"train.{name}": _last_given(spelt, [], "train", name, _NOT_GIVEN) for name in _CONDITIONAL_ONLY}
        found["model.class_names"] = _last_given(spelt, [], "model", "class_names", _NOT_GIVEN)
        given.append((source, {k: v for k, v in found.items() if v is not _NOT_GIVEN}))
    for source, values in given:
        conditional = "conditional=True" if _said(source).api else "--conditional"
        if values.get("model.class_names"):  # names for classes an unconditional model does not have
            raise ConfigError(
                f"model.class_names={values['model.class_names']!r} ({source}) names a conditional model's classes, "
                f"and this run's model is unconditional, so they would be ignored: add {conditional} (on labelled "
                f"data) to train a class-conditional model with them, or leave {_said(source)('class-names')} out")
        for name in _CONDITIONAL_ONLY:
            key = f"train.{name}"
            if key in values and coerce(values[key], float, key) not in (getattr(defaults, name), 0.0):
                raise ConfigError(
                    f"{key}={values[key]!r} ({source}) is a conditional model's setting, and this run's model is "
                    f"unconditional, so it would be ignored: add {conditional} (on labelled data) to train a "
                    f"class-conditional model with it, or leave it out")


def _file_length_replaces(file, values: dict[str, Any]) -> dict[str, Any]:
    """A config file's (or config dict's) values, where one that sets one run length also clears the others it leaves
    out, as the other layers do (RUN_LENGTHS): `train: {max_steps: 100}` over cpu-demo (max_images) trains 100 steps.
    One that sets two lengths is still refused by TrainConfig."""
    train = values.get("train")
    given = {k.replace("-", "_") for k in train} if isinstance(train, dict) else set()
    given |= {qualify(k, str(file)).split(".", 1)[1] for k in values if k.startswith("train.")}
    if not given & set(RUN_LENGTHS):
        return values
    return {**values, **{f"train.{name}": None for name in RUN_LENGTHS if name not in given}}


def _said(source: str) -> Spelling:
    """How a refusal of the layer `source` names its fix: by fastddpm.train's keywords for its own layers (its
    keywords, a config dict), else by the command's flags."""
    return API if source in ("fastddpm.train", "config dict") else CLI


# the diffusion fields that only one objective reads (the others' noise levels are their own process)
_OBJECTIVE_ONLY = {"schedule": "ddpm", "beta_start": "ddpm", "beta_end": "ddpm", "num_timesteps": "ddpm",
                   "sigma_data": "edm", "edm_p_mean": "edm", "edm_p_std": "edm", "flow_shift": "flow"}
_OBJECTIVE_NAMES = {"ddpm": ("a DDPM setting", "a DDPM"), "edm": ("an EDM setting", "an EDM model"),
                    "flow": ("a flow-matching setting", "a flow-matching model")}


def _refuse_other_objectives(cfg: RunConfig, layers: list[tuple[str, dict[str, Any]]]) -> None:
    """A field that only another objective reads, given explicitly (a flag, --set, an API keyword), would be ignored
    without a word, e.g. `--preset cpu-demo --schedule linear`, written when cpu-demo trained a DDPM, or
    `--set diffusion.flow_shift=3` on a DDPM. Config files are not checked: a run's saved config.json carries every
    field."""
    objective = cfg.diffusion.objective
    for source, values in layers:
        for name, owner in _OBJECTIVE_ONLY.items():
            if owner != objective and f"diffusion.{name}" in values:
                raise ConfigError(
                    f"diffusion.{name}={values[f'diffusion.{name}']!r} ({source}) is {_OBJECTIVE_NAMES[owner][0]}, "
                    f"and this run's objective is {objective}, so it would be ignored: add "
                    f"{_said(source)('objective', owner)} to train {_OBJECTIVE_NAMES[owner][1]} with it, or leave it "
                    "out")


def _refuse_unread_betas(cfg: RunConfig, layers: list[tuple[str, dict[str, Any]]]) -> None:
    """beta_start and beta_end set the linear schedule's betas; the cosine schedule computes its own, so a beta
    given explicitly with it (`--preset ddpm-rgb64 --beta-end 0.01`, ddpm-rgb64 being cosine) would be ignored
    without a word. A beta set to none is no setting."""
    if cfg.diffusion.objective != "ddpm" or cfg.diffusion.schedule == "linear":
        return
    for source, values in layers:
        for name in ("beta_start", "beta_end"):
            value = values.get(f"diffusion.{name}")
            if value is not None and getattr(cfg.diffusion, name) is not None:
                raise ConfigError(
                    f"diffusion.{name}={value!r} ({source}) sets the linear schedule's betas, and this run's "
                    f"schedule is {cfg.diffusion.schedule}, which computes its own, so it would be ignored: add "
                    f"{_said(source)('schedule', 'linear')} to train with it, or leave it out")


def _refuse_other_families(cfg: RunConfig, layers: list[tuple[str, dict[str, Any]]]) -> None:
    """A model field that only the other U-Net family reads (model_checks.FAMILY_ONLY), given explicitly (a flag,
    --set, an API keyword), would be ignored without a word, e.g. `--preset seed-2layer --dropout 0.1` (the seed's
    U-Net has no dropout). The defaults and a preset's or a diffusers folder's values are no layer here, and config
    files are not checked (a run's saved config.json carries every field)."""
    family = cfg.model.family
    for source, values in layers:
        for name, owner in FAMILY_ONLY.items():
            if owner != family and f"model.{name}" in values:
                presets = [preset for preset in PRESETS if get_preset(preset).model.family == owner]
                said = _said(source)
                # fastddpm.train takes the preset as its first argument (a preset= keyword is refused)
                preset = (f"the preset {' / '.join(map(repr, presets))} as fastddpm.train's first argument"
                          if said.api else f"--preset {' / '.join(presets)}")
                raise ConfigError(
                    f"model.{name}={values[f'model.{name}']!r} ({source}) is read only by the {owner} family's U-Net, "
                    f"and this run's model.family is {family}, so it would be ignored: train a {owner}-family U-Net "
                    f"with it ({said('family', owner)}, or {preset}), or leave it out")


_NOT_GIVEN = object()


def _last_given(file_values: dict, layers: list[tuple[str, dict[str, Any]]], section: str, name: str,
                default: Any = None) -> Any:
    """The value the config file and the layers leave for section.name (the last one given), `default` if none."""
    value = default
    nested = file_values.get(section)
    for given in ([nested] if isinstance(nested, dict) else []) + [file_values] + [v for _, v in layers]:
        for key in (name, f"{section}.{name}"):
            if key in given:
                value = given[key]
    return value


def device_setting(cfg: RunConfig, file: str | Path | None) -> str:
    """How an error of the run's device names it: by the config `file` and key where the device is the file's (no
    flag, --set or keyword replaced it), else as the field, train.device. The device is resolved where the run
    starts, which knows no file: a `device: cuda` on a machine without one had been refused naming no file."""
    if file is None or Path(file).suffix.lower() not in (".yaml", ".yml", ".json"):
        return "train.device"
    given = _last_given(load_config_file(file), [], "train", "device")
    return f"config file {file}: train.device" if given is not None and given == cfg.train.device else "train.device"


def _init_from(cfg: RunConfig, file_values: dict, layers: list[tuple[str, dict[str, Any]]]) -> str | None:
    """train.init_from as the layers leave it: the last layer's, else the file's, else `cfg`'s."""
    given = _last_given(file_values, layers, "train", "init_from", default=_NOT_GIVEN)
    value = cfg.train.init_from if given is _NOT_GIVEN else coerce(given, str | None, "train.init_from")
    return value or None


def _layered(cfg: RunConfig, layers: list[tuple[str, dict[str, Any]]]) -> RunConfig:
    for source, values in layers:
        dotted = {qualify(k, source): v for k, v in values.items()}
        lengths = {f"train.{name}" for name in RUN_LENGTHS}
        if lengths & dotted.keys():
            dotted.update({key: None for key in lengths - dotted.keys()})
        cfg = apply_overrides(cfg, dotted, source=source)
    return cfg
