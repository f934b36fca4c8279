"""What a resume must keep from the run it continues, checked before the first step: the seed and the data (each
step's batch, timesteps and noise are drawn from them by (seed, step)), and a run length that leaves steps to train;
and what it leaves behind, set aside: a later branch's checkpoints and records.
"""

from __future__ import annotations

from fastddpm.config import PRESETS, RUN_LENGTHS, ConfigError, DataConfig, RunConfig, get_preset
from fastddpm.config.errors import CLI, Spelling
from fastddpm.data.cache import describe_identity, same_images
from fastddpm.rundir import metrics
from fastddpm.rundir.checkpointer import Checkpointer
from fastddpm.rundir.layout import RunDir
from fastddpm.rundir.locate import Checkpoint


def check_same_inputs(resumed: Checkpoint, cfg: RunConfig, identity: dict, log, said: Spelling = CLI) -> None:
    """Step k's batch, timesteps and noise are drawn from the data by (seed, k): a resume on other data or with
    another seed would be another run, not this one continued. Refused naming what changed and the ways on; the
    same images read from another path (a moved folder, a named dataset's own files) are the same run, said in a
    note. An unconditional model reads no labels, so only its pixels are compared. A checkpoint written before the
    data was recorded in it is not checked for the data."""
    was_seed = resumed.config.train.seed
    if was_seed != cfg.train.seed:
        preset = cfg.preset is not None and cfg.preset != resumed.config.preset
        # fastddpm.train takes the preset as its first argument (a preset= keyword is refused)
        given = ("fastddpm.train's first argument or a config file's `preset`" if said.api else
                 "from the command line or a config file")
        raise ConfigError(
            f"cannot resume from {resumed.path}: train.seed was {was_seed} in the checkpoint but is {cfg.train.seed} "
            f"now; every step's data order, timesteps and noise come from the seed. "
            + (f"A {'preset' if said.api else '--preset'} (here {cfg.preset}, {given}) replaces the run's whole "
               f"config on resume, its seed and data included: resume without it, or start a new run directory"
               if preset else
               f"Pass {said('seed', was_seed)} (or resume without {said('seed')}"
               + (f" and without {'the preset ' + repr(cfg.preset) if said.api else '--preset ' + cfg.preset}: a "
                  "preset given on resume replaces the run's whole config, its seed included"
                  if _presets_seed(cfg) else "") + "), or start a new run directory"))
    was_flip = resumed.config.data.hflip
    if was_flip != cfg.data.hflip:  # an augmentation switched on or off: the run goes on, no longer as it began
        log(f"note: data.hflip was {'on' if was_flip else 'off'} in the checkpoint's run and is "
            f"{'on' if cfg.data.hflip else 'off'} now: the steps from here see other flips than an uninterrupted "
            f"run would ({said('hflip', was_flip) if said.api else '--' + ('hflip' if was_flip else 'no-hflip')} "
            "keeps its own)")
    saved = resumed.meta.get("data")
    if not saved or same_images(saved, identity, labels=cfg.model.conditional):
        if saved and saved.get("source") != cfg.data.source:
            log(f"note: the checkpoint's run read its data from {saved.get('source')}, this run from "
                f"{cfg.data.source}: the same images (count, shape and sampled pixels"
                f"{', classes and labels' if cfg.model.conditional else ''}), so the run continues")
        return
    was = resumed.config.data
    # the run's own reading options: those it set, and those this resume changed (--split train for a --split test)
    options = [said(k.replace('_', '-'), getattr(was, k)) for k in _READ_AS
               if getattr(was, k) is not None and (k != "resize_mode" or was.resize)
               and (getattr(was, k) != getattr(DataConfig(), k) or getattr(was, k) != getattr(cfg.data, k))]
    dropped = [said(k.replace('_', '-')) for k in ("resize", "image_mode") if getattr(was, k) is None
               and getattr(cfg.data, k) is not None]  # options this resume added that the run did not have
    if saved.get("source") == cfg.data.source and _read_as(was) == _read_as(cfg.data):
        what = (f"the images at {cfg.data.source} changed since the checkpoint was written "
                f"({_changes(saved, identity, labels=cfg.model.conditional)}: files added, removed, edited or "
                f"replaced, or the cache rebuilt by another decoder)")
        ways = f"Put its images back, or train on these in a new {said('out')}"
    else:
        what = (f"its run trained on {saved.get('source')} ({describe_identity(saved)}), this one's data is "
                f"{cfg.data.source} ({describe_identity(identity)})")
        ways = (f"Resume on its data ({(', ' if said.api else ' ').join([said('data', saved.get('source')), *options])}"
                f"{', without ' + ' and '.join(dropped) if dropped else ''}), or train on this data in a new "
                f"{said('out')}")
    if cfg.model.family == "ddpm" and cfg.diffusion.objective == "ddpm":
        ways += (f" (from these weights: `fastddpm export --format diffusers`, then {said('init-from')} that "
                 "folder)")
    raise ConfigError(f"cannot resume from {resumed.path}: {what}; each step's batch is drawn from the data, so "
                      f"this would be another run, not this one continued. {ways}")


def _presets_seed(cfg: RunConfig) -> bool:
    """Whether cfg's seed is its preset's own: the mark of a --preset given on resume (which replaces the run's
    config); without one, a seed other than the run's was given as such."""
    try:
        return cfg.preset is not None and get_preset(cfg.preset).train.seed == cfg.train.seed
    except ConfigError:  # a preset this version no longer has
        return False


# the data options that change what is read from a source: with the same source and these, other images are the
# source's files changed, not other data asked for
_READ_AS = ("resize", "resize_mode", "image_mode", "split")


def _read_as(data: DataConfig) -> dict:
    """The _READ_AS options that change what is read: the resize mode only with a resize."""
    return {k: getattr(data, k) for k in _READ_AS if k != "resize_mode" or data.resize is not None}


def _changes(saved: dict, now: dict, *, labels: bool) -> str:
    """What differs between two PreparedData.identity() records of one source, as said to a user; the classes only
    where `labels` (a conditional model reads them)."""
    said = []
    if saved.get("num_images") != now.get("num_images"):
        said.append(f"{saved.get('num_images')} images then, {now.get('num_images')} now")
    if saved.get("image_shape") != now.get("image_shape"):
        said.append(f"shape {tuple(saved.get('image_shape') or ())} then, {tuple(now.get('image_shape') or ())} now")
    if labels and saved.get("class_names") != now.get("class_names"):
        said.append(f"classes {', '.join(saved.get('class_names') or ()) or 'none'} then, "
                    f"{', '.join(now.get('class_names') or ()) or 'none'} now")
    if said:
        return "; ".join(said)
    return ("the same count, shape and classes; sampled pixels or labels differ" if labels else
            "the same count and shape; sampled pixels differ")


# the train settings a resume may change that change the weights from there on (the batch size has its own note,
# the seed and the data are refused, the run length is check_run_length's)
RECIPE = ("lr", "adam_betas", "weight_decay", "warmup_images", "grad_clip", "ema_decay", "ema_warmup", "ema_every",
          "cond_drop_prob", "min_snr_gamma")


def recipe_changes(resumed: Checkpoint, cfg: RunConfig) -> list[str]:
    """A note naming each RECIPE setting this resume changed, was and now: the run goes on with the new values
    (a schedule changed by hand is common), and config.json, rewritten, keeps only those."""
    was, now = resumed.config.train, cfg.train
    changed = [f"train.{k} {getattr(was, k)!r} -> {getattr(now, k)!r}" for k in RECIPE
               if getattr(was, k) != getattr(now, k)]
    if not changed:
        return []
    return [f"note: this resume changes {'; '.join(changed)}: the steps from here train with the new value"
            f"{'s' if len(changed) > 1 else ''} (config.json now holds them; {resumed.path} keeps the run's own)"]


def init_from_note(resumed: Checkpoint, cfg: RunConfig, said: Spelling = CLI) -> list[str]:
    """--init-from on a resume: the weights are the checkpoint's, whatever folder it names. A note when it names
    another folder than the run started from (config.json keeps the run's own)."""
    given, own = cfg.train.init_from, resumed.config.train.init_from
    if not given or given == own:
        return []
    began = f"started from {own}" if own else "started from fresh weights"
    return [f"note: {said('init-from', given)} is not used when resuming: the run {began}, and its weights are "
            f"in {resumed.path} (to start a new run from {given}, give another {said('out')})"]


def unconditional_init_note(cfg: RunConfig, said: Spelling = CLI) -> list[str]:
    """A new run from a folder whose UNet2DModel has no class embedding, over a class-conditional preset (the
    CPU's default, cpu-demo-cond): the folder sets the architecture, so the run trains an unconditional model,
    which the preset's name would not say. Conditioning cannot be added to such weights: the embedding has no
    rows to load."""
    if not cfg.train.init_from or cfg.model.conditional or cfg.preset not in PRESETS \
            or not get_preset(cfg.preset).model.conditional:
        return []
    return [f"note: {said('init-from', cfg.train.init_from)} holds an unconditional UNet2DModel (no num_class_embeds) "
            f"and sets the model: this run trains an unconditional model, not the {cfg.preset} preset's "
            "class-conditional one (config.json: model.conditional false, train.cond_drop_prob 0). For a "
            f"class-conditional model, leave {said('init-from')} out, or start from a conditional model's folder "
            "(`fastddpm export RUN --format diffusers` of a conditional run)"]


def run_length(cfg: RunConfig, said: Spelling = CLI) -> str:
    """The run's length as its flag spells it: "--max-steps 500", "--max-images 60,000", "--max-epochs 2.5"
    (fastddpm.train's keyword: "max_steps=500")."""
    name = next(name for name in RUN_LENGTHS if getattr(cfg.train, name) is not None)
    value = getattr(cfg.train, name)
    if said.api:
        return said(name, value)
    return f"--{name.replace('_', '-')} {value:,}" if isinstance(value, int) else f"--{name.replace('_', '-')} {value}"


def check_run_length(resumed: Checkpoint, cfg: RunConfig, *, step: int, end_step: int, was_end_step: int,
                     said: Spelling = CLI) -> list[str]:
    """A resume that sets another length: `end_step` is the step the run now ends at, `was_end_step` the one its
    checkpoint's run was to end at (both at this run's batch). A length that ends the run at or before the
    checkpoint's `step` would train nothing and leave the shorter length in config.json, where a later plain resume
    reads it as the run being done: refused. Otherwise a note says where the end moved, if it did."""
    if all(getattr(resumed.config.train, name) == getattr(cfg.train, name) for name in RUN_LENGTHS):
        return []
    was, now = run_length(resumed.config, said), run_length(cfg, said)
    if end_step <= step:
        finish = (" (the run as it began is done; its weights are in the checkpoint)" if was_end_step <= step else
                  ", or resume without this length (from a flag or a config file) to finish the run as it began")
        raise ConfigError(
            f"{now} ends this run at step {end_step:,}, and {resumed.path} is at step {step:,}, so nothing would be "
            f"trained (the run was to train to step {was_end_step:,}, {was}): give a length beyond step {step:,}"
            f"{finish}")
    if end_step == was_end_step:  # the same end, given in other units
        return []
    return [f"note: this run now ends at step {end_step:,} ({now}); it was to end at step {was_end_step:,} ({was})"]


def set_aside_the_abandoned(rd: RunDir, checkpointer: Checkpointer, step: int, log) -> bool:
    """A resume from `step` trains the later steps again: what the run wrote after it (checkpoints of a branch it
    leaves; the metrics of steps a killed run logged after its last checkpoint) is moved aside, not deleted. Done at
    the resume, before this run writes anything: a run that then stops before its first save leaves the branch
    point as the newest checkpoint, which is where `--resume latest` then goes. Returns whether the resume leaves
    a branch (checkpoints of later steps set aside): its later steps differ from what the loggers hold of them."""
    set_aside = checkpointer.set_aside_after(step)
    if set_aside is not None:
        folder, steps = set_aside
        log(f"this resume starts a new branch at step {step:,}: the later checkpoints of the branch it leaves "
            f"(steps {', '.join(f'{s:,}' for s in steps)}) moved to {folder}, so that --resume latest continues "
            f"this one")
    for path in (rd.metrics, rd.eval_log):
        moved = metrics.set_aside_after(path, step)
        if moved:
            log(f"{path.name}: {moved} record(s) of steps after {step:,}, trained again now, moved to "
                f"{metrics.abandoned(path).name}")
    return set_aside is not None
