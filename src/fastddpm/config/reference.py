"""The config's reference, generated from the schema: flag names and docs/config.md
(`python -m fastddpm.config > docs/config.md`; a test keeps the file in sync)."""

from __future__ import annotations

import dataclasses

from fastddpm.config.schema import SECTIONS


def flag_name(f: dataclasses.Field) -> str:
    """The command-line flag of a config field: `--batch-size`, or its `cli` name (`--eval-every`)."""
    return "--" + (f.metadata.get("cli") or f.name).replace("_", "-")


def reference_markdown() -> str:
    """The table of every config field in docs/config.md (regenerate with `python -m fastddpm.config`)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `src/fastddpm/config/schema.py` by `python -m fastddpm.config > docs/config.md`; a test",
        "keeps it in sync. Every field is a flag of `fastddpm train` (shown), a `--set section.field=value` override,",
        "a key of a YAML/JSON `--config` file under its section, and a keyword of `fastddpm.train(...)`. Presets",
        "change some defaults: see `fastddpm train --help`.",
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"## {section}", "", cls.__doc__.strip().splitlines()[0], "",
                  "| field | flag | default | meaning |", "| --- | --- | --- | --- |"]
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            flag = flag_name(f)
            text = f.metadata["help"]
            if f.metadata.get("choices"):
                text += " One of: " + ", ".join("none" if c is None else c for c in f.metadata["choices"]) + "."
            lines.append(f"| `{f.name}` | `{flag}` | `{shown}` | {text} |")
    return "\n".join(lines) + "\n"
