"""Typed run configuration: one keyword-only dataclass per component, each field documented and validated.

A run's config is resolved in layers, later layers winning:
    preset (a plain function)  <  --config FILE (YAML or JSON)  <  --set section.field=value  <  flags
and, when resuming without --preset, the checkpoint's own config takes the place of the preset. The Python API
resolves its keyword arguments the same way (overrides.resolve_config). The resolved config is written into every
run directory as config.json, and `fastddpm train --help` and docs/config.md are generated from the field docs.

    schema.py      ModelConfig, DiffusionConfig, DataConfig, TrainConfig, RunConfig
    model_checks.py  the U-Net options' checks per family, and the fields only one family reads
    errors.py      ConfigError, and Spelling: an argument named as the command line or the Python API spells it
    sampling.py    sampler names, spacings and defaults: what `auto` samples each objective with
    presets.py     the presets, one function each
    overrides.py   files, flags and keyword arguments coerced and layered: resolve_config, apply_overrides
    shape.py       the model's shape and classes from the data; what a resume must keep the same
    reference.py   flag names and the generated docs/config.md
    diffusers_unet.py  the ddpm family's options and diffusers' UNet2DModel config.json, both ways

No module here imports any other part of fastddpm: every package may import the config.
"""

from fastddpm.config.errors import API, CLI, Spelling
from fastddpm.config.keywords import check_keyword_types
from fastddpm.config.overrides import (RUN_LENGTHS, apply_overrides, coerce, device_setting, field_types, from_dict,
                                       load_config_file, positive_int, qualify, resolve_config, save_config)
from fastddpm.config.presets import PRESETS, default_preset, get_preset, preset_summaries
from fastddpm.config.reference import flag_name, reference_markdown
from fastddpm.config.sampling import (DEFAULT_SAMPLER, DEFAULT_SAMPLER_STEPS, SAMPLER_CHOICES, SAMPLER_HELP, SAMPLERS,
                                      SPACINGS, STEPS_HELP, default_spacing, resolve_sampling)
from fastddpm.config.schema import (LOGGERS, SECTIONS, ConfigError, DataConfig, DiffusionConfig, ModelConfig,
                                    RunConfig, TrainConfig)
from fastddpm.config.shape import (check_same_architecture, class_index, class_slug, not_a_number,
                                   resolve_classes, resolve_model_shape)

__all__ = [
    "ConfigError", "Spelling", "CLI", "API",
    "RunConfig", "ModelConfig", "DiffusionConfig", "DataConfig", "TrainConfig", "SECTIONS",
    "SAMPLERS", "SAMPLER_CHOICES", "SAMPLER_HELP", "STEPS_HELP", "SPACINGS", "LOGGERS", "DEFAULT_SAMPLER",
    "DEFAULT_SAMPLER_STEPS", "default_spacing", "resolve_sampling",
    "PRESETS", "default_preset", "get_preset", "preset_summaries",
    "resolve_config", "apply_overrides", "qualify", "RUN_LENGTHS", "coerce", "field_types", "load_config_file",
    "device_setting",
    "from_dict", "save_config", "positive_int", "check_keyword_types",
    "resolve_model_shape", "resolve_classes", "class_index", "class_slug", "not_a_number",
    "check_same_architecture",
    "flag_name", "reference_markdown",
]
