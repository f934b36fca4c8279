"""What the data and a checkpoint decide about a config: the model's image shape and classes from the data, the
class `--class` names, and what a resume must keep the same."""

from __future__ import annotations

import dataclasses
import operator
import re
from pathlib import Path
from typing import Any

from fastddpm.config.diffusers_unet import read_unet_config
from fastddpm.config.errors import CLI, Spelling
from fastddpm.config.model_checks import check_attention_levels
from fastddpm.config.schema import ConfigError, ModelConfig, RunConfig

def resolve_model_shape(cfg: RunConfig, images_NCHW_shape: tuple[int, ...], *, new_model: bool = True) -> RunConfig:
    """Fill model.image_channels / image_size from the data, or check the ones the user set. `new_model`: also
    refuse what a saved run may hold but a new one should not (attention_resolutions that match no level)."""
    _, c, h, w = images_NCHW_shape
    if h != w:
        raise ConfigError(f"the data's images are {h}x{w}; the U-Net wants square images: use --resize N")
    m = cfg.model
    for name, have in (("image_channels", c), ("image_size", h)):
        want = getattr(m, name)
        if want is not None and want != have:
            raise ConfigError(
                f"model.{name}={want} but the data has {have}: drop the setting (it comes from the data) "
                + ("or use --resize" if name == "image_size" else "or use --image-mode L|RGB")
            )
    model = dataclasses.replace(m, image_channels=c, image_size=h)
    model.validate_shape()
    if new_model:
        check_attention_levels(model)
    return dataclasses.replace(cfg, model=model)


def resolve_classes(cfg: RunConfig, labels: Any, class_names: list[str], source: str) -> RunConfig:
    """A conditional model's classes from the data: their number from the labels (or the data's class list, if
    longer) and their names (the data's, else "0", "1", ...). Data without labels is refused with the fix."""
    m = cfg.model
    if not m.conditional:
        return cfg
    unlabeled = int((labels < 0).sum()) if len(labels) else 0
    if not len(labels) or unlabeled:
        what = "no labels" if not len(labels) or unlabeled == len(labels) else f"{unlabeled} images without a label"
        # train --init-from reads model.conditional from the folder's num_class_embeds: the user may have given
        # no --conditional to drop
        folder = (f" (here --init-from {cfg.train.init_from} made it conditional: its UNet2DModel has a class "
                  "embedding, num_class_embeds; start from an unconditional one)"
                  if cfg.train.init_from and _folder_is_conditional(cfg.train.init_from) else "")
        raise ConfigError(
            f"--conditional trains on class labels, and {source} has {what}: use a labelled source (a folder of "
            f"class sub-folders, an .npz with `labels`, mnist / fashion-mnist / cifar10), or drop --conditional"
            + folder)
    class_names = _given_or_data_names(m.class_names, [str(c) for c in class_names], labels, source)
    n = max(int(labels.max()) + 1, len(class_names))
    names = tuple(class_names) + tuple(str(i) for i in range(len(class_names), n))
    if m.num_classes and m.num_classes != n:
        raise ConfigError(f"model.num_classes={m.num_classes} but the data has {n} classes: drop the setting (it "
                          f"comes from the data)")
    return dataclasses.replace(cfg, model=dataclasses.replace(m, num_classes=n, class_names=names))


def _given_or_data_names(given: tuple[str, ...], data_names: list[str], labels: Any, source: str) -> list[str]:
    """The class names to train with: the data's, or model.class_names (`--class-names`) where the data only
    numbers its classes ("0", "1", ... or nothing: an .npz without class_names, folders named by id). Given names
    that would rename the data's own are refused: the model would be named one way and its data another."""
    if not given:
        return data_names
    given = [str(g) for g in given]
    if given == data_names:  # a resume: config.json holds the names this resolution gave
        return data_names
    shown = ",".join(given)
    if any(name != str(i) for i, name in enumerate(data_names)):
        raise ConfigError(
            f"--class-names {shown} (model.class_names) differs from the class names {source} carries "
            f"({', '.join(data_names)}): a model's classes are its data's. Fix: drop --class-names to train with "
            "the data's names, or prepare the data again under the names you want (rename its class folders, or "
            "save an .npz with those class_names)")
    needed = int(labels.max()) + 1
    if len(given) < needed:
        raise ConfigError(
            f"--class-names {shown} (model.class_names) names {len(given)} classes, but {source} has labels up to "
            f"{needed - 1}, {needed} classes: give one name per class id 0-{needed - 1}, in id order")
    return given


def _folder_is_conditional(folder: str) -> bool:
    try:
        return read_unet_config(folder)[1].get("num_class_embeds") is not None
    except ConfigError:  # not a diffusers folder: --init-from's own check names that
        return False


def class_index(model_cfg: ModelConfig, name_or_id: str | int, *, said: Spelling = CLI) -> int:
    """The class id that `--class` names: a class name (as written, else ignoring case, else as file names spell
    it, where one class alone matches) or a number; a Python int is always an
    id (class folders named 1/, 2/, 3/ are ids 0, 1, 2: the string "2" is the folder, the int 2 the id). Refused
    naming the valid ones, the argument spelt as `said` (the command's flag or the API's parameter)."""
    names = model_cfg.class_names
    if not model_cfg.conditional:
        raise ConfigError(f"{said('class', name_or_id)}: this model is unconditional (trained without "
                          f"--conditional); sample without {said('class')}")

    def not_one_class() -> ConfigError:
        return ConfigError(f"{said('class', name_or_id)}: one class per call, as a name, an id (an int) or 'all' "
                           f"({_list_classes(names)}); for several classes, call once per class or draw 'all'")

    if not isinstance(name_or_id, str) and not_a_number(name_or_id):
        raise not_one_class()
    if not isinstance(name_or_id, str):  # an int, a numpy integer or a 0-d integer tensor
        try:
            name_or_id = operator.index(name_or_id)
        except TypeError:  # a float, a list or an array of labels
            raise not_one_class() from None
        if 0 <= name_or_id < model_cfg.num_classes:
            return name_or_id
        raise ConfigError(f"class id {name_or_id} is out of range: this model has classes 0-"
                          f"{model_cfg.num_classes - 1} ({_list_classes(names)})")
    wanted = str(name_or_id).strip()
    shown = name_or_id if said.api else repr(name_or_id)  # the API's spelling quotes it already
    # the name as written, else ignoring case, else as file names spell it (class_slug: "ankle-boot"; not for a
    # number, nor for what has no letters or digits to spell)
    numeric = re.fullmatch(r"[+-]?\d+", wanted) is not None
    for same, how in ((lambda n: n, ""), (str.casefold, " ignoring case"), (class_slug, " as file names spell them")):
        if same is class_slug and (numeric or not class_slug(wanted)):
            break
        found = [i for i, name in enumerate(names) if same(name) == same(wanted)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ConfigError(f"{said('class', shown)} matches {len(found)} classes{how} "
                              f"({', '.join(f'{i} {names[i]!r}' for i in found)}): give the name as written, or its "
                              f"number")
    tagged = re.fullmatch(r"(.+)-(\d+)", wanted)  # the file names' spelling where two names spell alike: cat-1
    if tagged and int(tagged[2]) < len(names) and class_slug(names[int(tagged[2])]) == tagged[1]:
        i = int(tagged[2])
        if [class_slug(n) for n in names].count(tagged[1]) > 1:
            return i
    if wanted.lstrip("-").isdigit():
        i = int(wanted)
        if 0 <= i < model_cfg.num_classes:
            return i
        raise ConfigError(f"{said('class', wanted)} is out of range: this model has classes 0-"
                          f"{model_cfg.num_classes - 1} ({_list_classes(names)})")
    raise ConfigError(f"{said('class', shown)} is not one of this model's classes: {_list_classes(names)} (a name "
                      f"or its number, or all)")


def not_a_number(value) -> bool:
    """Whether `value`, which float() or operator.index() may read as a number, is none: a bool (Python's, numpy's,
    a bool tensor: True would be 1), text (str, bytes, bytearray: "2" would be 2), a complex number (its real part
    would be read), or an array or tensor that is not 0-d (torch.tensor([2]) is a batch of one label, read as 2)."""
    if isinstance(value, (bool, str, bytes, bytearray, memoryview, complex)):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is not None and (str(dtype) in ("torch.bool", "torch.complex64", "torch.complex128")
                              or getattr(dtype, "kind", "") in ("b", "U", "S", "O", "c")):
        return True  # numpy's bool, text, object and complex arrays (np.array("2") is text)
    return getattr(value, "ndim", 0) != 0


def class_slug(name: str) -> str:
    """A class name as file names spell it: lower case, each run of other characters one hyphen ("T-shirt/top"
    -> "t-shirt-top", "Ankle boot" -> "ankle-boot")."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def _list_classes(names: tuple[str, ...]) -> str:
    return ", ".join(f"{i} {n!r}" for i, n in enumerate(names))


def check_same_architecture(saved: RunConfig, current: RunConfig, path: Path, said: Spelling = CLI) -> None:
    """Resuming with a different model or diffusion process cannot be exact: name the field that changed, and the
    fix as the caller gives it (`said`: the command's flags, or fastddpm.train's arguments)."""
    _check_same_betas(saved.diffusion, current.diffusion, path, said)
    for section in ("model", "diffusion"):
        a, b = dataclasses.asdict(getattr(saved, section)), dataclasses.asdict(getattr(current, section))
        for key in a:
            if section == "diffusion" and key in ("beta_start", "beta_end"):
                continue  # compared as the betas they give, above
            if a[key] != b[key]:
                raise ConfigError(
                    f"cannot resume from {path}: {section}.{key} was {a[key]!r} in the checkpoint but is {b[key]!r} "
                    f"now{_preset_says(current, section, key, said)}; drop the change, or start a new run directory"
                )


def _preset_says(current: RunConfig, section: str, key: str, said: Spelling = CLI) -> str:
    """Where the new value is the preset's: a resume given --preset starts from the preset, not from the run's own
    config, so a value the user never typed differs (the run's --objective flow against the preset's ddpm).
    fastddpm.train takes the preset as its first argument (a preset= keyword is refused), which `said.api` names."""
    from fastddpm.config.presets import PRESETS

    make = PRESETS.get(current.preset or "")
    value = getattr(getattr(make(), section), key, _NOWHERE) if make is not None else _NOWHERE
    if value is _NOWHERE or value != getattr(getattr(current, section), key):
        return ""
    if said.api:
        return (f" ({value!r} is the {current.preset} preset's value: where a preset is given (fastddpm.train's first "
                "argument, or a config file's `preset`), a resume starts from the preset's values, not the run's; "
                "without one, fastddpm.train(out=..., resume='latest') goes on with the run's own)")
    return (f" ({value!r} is the {current.preset} preset's value: where --preset is given, a resume starts from the "
            "preset's values, not the run's; without --preset it goes on with the run's own)")


_NOWHERE = object()


def _check_same_betas(saved, current, path: Path, said: Spelling = CLI) -> None:
    """The linear schedule's betas as they come out (unset and Ho et al.'s written out are the same at T = 1000).
    A run saved with betas written out at another T trained them unscaled: name the flags that resume it."""
    if saved.schedule != "linear" or current.schedule != "linear" or saved.num_timesteps != current.num_timesteps:
        return  # the schedule or T differs: the field comparison names it
    was, now = saved.linear_beta_range(), current.linear_beta_range()
    if was != now:
        betas = (f"beta_start={was[0]:g}, beta_end={was[1]:g}" if said.api else
                 f"--beta-start {was[0]:g} --beta-end {was[1]:g}")
        raise ConfigError(
            f"cannot resume from {path}: its linear betas run from {was[0]:g} to {was[1]:g} and this run's from "
            f"{now[0]:g} to {now[1]:g} (unset, they are Ho et al.'s scaled by 1000 / T): resume with {betas}, or "
            "start a new run directory")
