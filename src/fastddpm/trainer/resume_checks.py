"""What a resume must keep from the run it continues, checked before the first step: the seed and the data (each
step's batch, timesteps and noise are drawn from them by (seed, step)), and a run length that leaves steps to train.
"""

from __future__ import annotations

from fastddpm.config import RUN_LENGTHS, ConfigError, RunConfig
from fastddpm.data.cache import describe_identity
from fastddpm.rundir.locate import Checkpoint


def check_same_inputs(resumed: Checkpoint, cfg: RunConfig, identity: dict, log) -> None:
    """Step k's batch, timesteps and noise are drawn from the data by (seed, k): a resume on other data or with
    another seed would be another run, not this one continued. Refused naming what changed and the ways on; the
    same images read from another path (a moved folder) are the same run, said in a note. A checkpoint written
    before the data was recorded in it is not checked for the data."""
    was_seed = resumed.config.train.seed
    if was_seed != cfg.train.seed:
        raise ConfigError(
            f"cannot resume from {resumed.path}: train.seed was {was_seed} in the checkpoint but is {cfg.train.seed} "
            f"now (a --seed, or a --preset's own); every step's data order, timesteps and noise come from the seed: "
            f"pass --seed {was_seed} (or resume without --preset and --seed), or start a new run directory")
    saved = resumed.meta.get("data")
    if not saved:
        return
    if {k: saved.get(k) for k in identity} != identity:
        raise ConfigError(
            f"cannot resume from {resumed.path}: its run trained on {saved.get('source')} "
            f"({describe_identity(saved)}), this one's data is {cfg.data.source} ({describe_identity(identity)}); "
            f"each step's batch is drawn from the data, so this would be another run, not this one continued. "
            f"Resume on its data (--data "
            f"{saved.get('source')}, with its --resize and --image-mode), or train on this data in a new --out "
            f"(from these weights: export a ddpm-family model with `fastddpm export --format diffusers` and pass "
            f"--init-from that folder)")
    if saved.get("source") != cfg.data.source:
        log(f"note: the checkpoint's run read its data from {saved.get('source')}, this run from {cfg.data.source}: "
            f"the same images (count, shape, classes and sampled pixels), so the run continues")


def run_length(cfg: RunConfig) -> str:
    """The run's length as its flag spells it: "--max-steps 500", "--max-images 60,000", "--max-epochs 2.5"."""
    name = next(name for name in RUN_LENGTHS if getattr(cfg.train, name) is not None)
    value = getattr(cfg.train, name)
    return f"--{name.replace('_', '-')} {value:,}" if isinstance(value, int) else f"--{name.replace('_', '-')} {value}"


def check_run_length(resumed: Checkpoint, cfg: RunConfig, *, step: int, end_step: int, was_end_step: int
                     ) -> list[str]:
    """A resume that sets another length: `end_step` is the step the run now ends at, `was_end_step` the one its
    checkpoint's run was to end at (both at this run's batch). A length that ends the run at or before the
    checkpoint's `step` would train nothing and leave the shorter length in config.json, where a later plain resume
    reads it as the run being done: refused. Otherwise a note says the end moved."""
    if all(getattr(resumed.config.train, name) == getattr(cfg.train, name) for name in RUN_LENGTHS):
        return []
    was, now = run_length(resumed.config), run_length(cfg)
    if end_step <= step:
        raise ConfigError(
            f"{now} ends this run at step {end_step:,}, and {resumed.path} is at step {step:,}, so nothing would be "
            f"trained (the run was to train to step {was_end_step:,}, {was}): give a length beyond step {step:,}, or "
            f"resume without {now.split()[0]} to finish the run as it began; its weights are in the checkpoint")
    return [f"note: this run now ends at step {end_step:,} ({now}); it was to end at step {was_end_step:,} ({was})"]
