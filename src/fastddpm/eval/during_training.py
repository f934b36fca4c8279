"""`fastddpm train --eval-every N`: FID from the EMA weights at fixed image counts, against training wall time.

Each evaluation samples `eval_samples` images with `eval_sampler` (`eval_steps` steps; `auto` resolved for the run's
objective, and the resolved names recorded) from the EMA weights, with the same noise every time (seed derived from
(run seed, "eval")), so successive points differ only by the weights. Under torchrun every rank draws a share of
the samples and extracts their features, rank 0 gathers and scores them: the samples one process would draw, in
1/N of the time on N GPUs.
It writes one record to metrics.jsonl ({"event": "eval", fid, precision, recall, wall_s, images_seen, ...}) and
a fuller one to eval.jsonl, and redraws RUN_DIR/eval_curve.png (FID vs wall time and vs images seen).

What it must not do, and how it doesn't:
  * count as training time: the loop moves its clocks forward by the evaluation's duration, so wall_s and
    images_per_s measure training only (compile included);
  * change the run: sampling uses its own generators, the global RNG is forked, the EMA model is only read;
    a run with --eval-every has the same losses and weights as one without (a test checks it).
Sampling runs eager on a GPU (bf16 autocast): compiling the EMA copy would cost more than the ~1 s it saves
per 1,000-sample evaluation, and would show up as recompiles in the training metrics.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from fastddpm.config import CLI, RunConfig, Spelling
from fastddpm.eval.curve import write_curve
from fastddpm.eval.evaluate import Evaluator, as_json_safe, quiet, summary_line
from fastddpm.rng import derive_seed
from fastddpm.rundir.layout import RunDir
from fastddpm.rundir.metrics import MetricsLog, read_metrics
from fastddpm.sampling import reshard, run_sampling

def evaluation_choices(cfg: RunConfig) -> dict:
    """The sampling choices every evaluation of cfg's run makes, as keywords of `Evaluator.evaluate`: the sample
    count, the noise seed (from (run seed, "eval"), so successive points differ only by the weights), the batch and
    the guidance scale. `--eval-every` and `bench quality`'s rescoring at another sampler both take them from here,
    so a rescored point differs from the run's own only by the sampler."""
    t = cfg.train
    return {"num_samples": t.eval_samples, "seed": derive_seed(t.seed, "eval"),
            # Sampling keeps no activations for backward: twice the training micro-batch fits where training does.
            "batch_size": min(t.eval_samples, 2 * t.batch_size),
            # a conditional model is sampled class-balanced at the grids' guidance scale
            "guidance": t.sample_guidance if cfg.model.conditional else None}


class TrainingEvaluator:
    """The evaluations of one run. Under torchrun every rank makes one (`rank`, `world_size`): each draws its
    share of the samples (an FSDP model's forward needs every rank) and extracts their features, rank 0 gathers
    and scores them, alone holding the reference statistics and the logs."""

    def __init__(self, cfg: RunConfig, *, run_dir: Path, device: torch.device, autocast_dtype: torch.dtype | None,
                 log: Callable[[str], None] = print, rank: int = 0, world_size: int = 1, said: Spelling = CLI):
        t = cfg.train
        # the Inception file's errors name train's own argument: --eval-inception, or fastddpm.train's eval_inception
        said = said.naming("inception", "eval-inception")
        self.cfg, self.device, self.autocast_dtype, self.log = cfg, device, autocast_dtype, log
        self.rank, self.world_size = rank, world_size
        self.every = t.eval_every_images
        self.choices = evaluation_choices(cfg)
        self.sampler, self.steps = run_sampling(cfg, "evaluations")  # `auto` resolved for the run's objective
        if rank != 0:
            # the feature network rank 0 trained or found and cached (the barrier: once it has)
            torch.distributed.barrier()
            self.evaluator = Evaluator.for_config(cfg, device=device, inception=t.eval_inception, log=quiet,
                                                  reference=False, said=said)
            self.evaluator.check_same_as_rank_0(rank, world_size)
            return
        self.evaluator = Evaluator.for_config(cfg, device=device, inception=t.eval_inception, log=log, said=said)
        if world_size > 1:
            torch.distributed.barrier()
            self.evaluator.check_same_as_rank_0(rank, world_size)
        self.eval_log = MetricsLog(RunDir(run_dir).eval_log)
        self.curve_path = RunDir(run_dir).eval_chart
        self.curve_ok = True
        shared = f", shared by {world_size} processes" if world_size > 1 else ""
        log(f"eval: every {self.every:,} images, {t.eval_samples:,} {self.sampler}-{self.steps} samples from the "
            f"EMA weights{shared}, in {self.evaluator.net.label}")

    def due(self, images_seen: int, images_per_step: int) -> bool:
        """True on the step that crosses a multiple of eval_every_images."""
        return images_seen // self.every > (images_seen - images_per_step) // self.every

    def missed(self, images_seen: int, images_per_step: int, *, at_end: bool) -> bool:
        """On a resume: the step the checkpoint was saved at was due an evaluation (crossing a multiple of
        eval_every_images, or the run's last) that eval.jsonl does not hold. A stop signal skips that evaluation
        and saves those very weights, so evaluating them now gives the record an uninterrupted run has. Rank 0
        reads the log; the other ranks answer False and take rank 0's answer (the loop shares it)."""
        if self.rank != 0 or images_seen <= 0 or not (at_end or self.due(images_seen, images_per_step)):
            return False
        records = read_metrics(self.eval_log.path) if self.eval_log.path.is_file() else []
        return not any(r.get("images_seen") == images_seen for r in records)

    def run(self, ema_model, *, step: int, images_seen: int, epoch: float, t_start: float,
            metrics: MetricsLog, should_stop: Callable[[], bool] | None = None) -> float:
        """Evaluate now; returns the seconds it took (for the loop to take out of its training clocks).
        `should_stop` (one process): asked before each sample batch; True ends it with EvaluationStopped."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # note: sync, so wall_s includes the queued training steps
        t_eval = time.perf_counter()
        wall_s = t_eval - t_start
        t = self.cfg.train
        shared = self.evaluator.evaluate(ema_model, self.cfg, rank=self.rank, world_size=self.world_size,
                                         sampler=self.sampler, steps=self.steps, device=self.device,
                                         autocast_dtype=self.autocast_dtype, should_stop=should_stop,
                                         **self.choices)
        reshard(ema_model)
        if shared is None:  # a rank other than 0: its share of the samples and features went to rank 0
            return time.perf_counter() - t_eval
        result, _ = shared
        eval_s = time.perf_counter() - t_eval
        record = {"event": "eval", "step": step, "images_seen": images_seen, "epoch": epoch, "wall_s": wall_s,
                  "fid": result["fid"], "precision": result["precision"], "recall": result["recall"],
                  "eval_samples": t.eval_samples, "eval_sampler": self.sampler, "eval_steps": self.steps,
                  "eval_s": eval_s, "features": result["features"], "features_label": result["features_label"]}
        if "coverage" in result:
            record["classes_present"] = result["coverage"]["classes_present"]
        if self.cfg.model.conditional:
            record.update(guidance=result["guidance"], class_accuracy=result["class_accuracy"])
        metrics.write(as_json_safe(record))
        self.eval_log.write(as_json_safe({**record, "coverage": result.get("coverage"),
                                          "sampling": result["sampling"], "score_s": result["score_s"]}))
        self.log(f"eval at {images_seen:,} images ({wall_s:.1f} s of training): {summary_line(result)}; "
                 f"took {eval_s:.1f} s")
        if self.curve_ok:
            records = read_metrics(self.eval_log.path)
            path = write_curve(records, self.curve_path, log=self.log,
                               title=f"{self.cfg.data.source}: FID ({result['features_label']}), "
                                     f"{t.eval_samples:,} samples, {self.sampler} {self.steps}")
            self.curve_ok = path is not None  # without matplotlib: say so once
        return time.perf_counter() - t_eval
