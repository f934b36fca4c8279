"""`fastddpm export`: a trained denoiser in a format other tools load, with what it takes to sample from it.

    fastddpm export RUN_DIR --format onnx|torch-export|safetensors|diffusers [--out DIR] [--weights ema|model]

The folder holds the model (model.onnx, model.pt2 or model.safetensors: the EMA weights, or with --weights model a
checkpoint's raw ones), schedule.json (the betas and what the network predicts: everything a sampler needs),
config.json (the resolved config) and README.md (a model card, fastddpm.export_card: data, images seen, FID where
the run or `fastddpm eval` measured these weights, the command that made it, and how to sample, in commands run
from the folder itself, so that they hold wherever it is copied or uploaded); an ONNX folder also holds
sample_onnx.py, a sampler that needs onnxruntime and numpy only (fastddpm.sample_onnx). The network is the U-Net alone,
eps_theta(x (B, C, H, W) float32 in [-1, 1], t (B,) int64) -> (B, C, H, W), plus y (B,) int64 for a conditional
model (its last id is the null class); for --objective edm or flow t is a float32 noise input and the output is
EDM's F or the velocity (schedule.json and the card say which, and how the network's input is made); the batch
axis is dynamic, 1 to 4096 images. An --out folder must be new, empty or an earlier export's (`--out .` would
write over a project's README.md). ONNX and torch.export outputs are checked here against PyTorch on the same
inputs, and the largest difference is written to export.json.

--format diffusers (ddpm family, --objective ddpm only) writes a folder diffusers loads with no fastddpm installed,
`DDPMPipeline.from_pretrained(DIR)`: unet/ (UNet2DModel), scheduler/ (DDPMScheduler), model_index.json and
README.md; see fastddpm.diffusers_io.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

FORMATS = ("onnx", "torch-export", "safetensors", "diffusers")


class ExportError(RuntimeError):
    """The exported file computes something else than the model (beyond TOLERANCE), or is not what was asked."""
# ONNX Runtime and torch.export against eager PyTorch in fp32: kernels differ, so not bit-exact; measured on the
# quickstart's U-Net here at ~1e-6 of an output of unit scale
TOLERANCE = 1e-3


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ep = subparsers.add_parser(
        "export", help="the (EMA) denoiser as ONNX, torch.export (.pt2), safetensors or a diffusers folder, with its "
                       "schedule and a card",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n  fastddpm export runs/fmnist --format onnx\n"
               "  fastddpm export runs/fmnist --format torch-export --out exports/fmnist-pt2\n"
               "  fastddpm export runs/cifar --format diffusers --out exports/cifar-diffusers   # DDPMPipeline\n"
               "  python exports/fmnist-onnx/sample_onnx.py exports/fmnist-onnx --out grid.png   # onnxruntime, numpy")
    ep.add_argument("run", metavar="RUN",
                    help="a run directory, a checkpoint (.pt), an ema.safetensors or a diffusers DDPMPipeline folder")
    ep.add_argument("--format", choices=FORMATS, required=True)
    ep.add_argument("--out", metavar="DIR", default=None, help="output folder (default RUN_DIR/export-<format>)")
    ep.add_argument("--opset", type=int, default=None, help="ONNX opset (default 18); --format onnx only")
    ep.add_argument("--weights", choices=("ema", "model"), default="ema",
                    help="EMA (default) or raw weights, as `fastddpm sample --weights`; raw ones need a checkpoint "
                         "(.pt or .dcp), not an ema.safetensors")
    ep.add_argument("--eval-results", metavar="PATH", action="append", default=[],
                    help="a `fastddpm eval` result (.json) or a folder of them, whose FID the card quotes where it "
                         "was measured of these weights; the run's eval/ and the results `eval --out` recorded "
                         "there are read without it (repeatable)")
    return ep


def _denoiser(model, conditional: bool):
    """The U-Net with a fixed signature for exporters: (x, t) or (x, t, y)."""
    import torch

    class Denoiser(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unet = model

        def forward(self, x, t, y=None):
            return self.unet(x, t, y) if conditional else self.unet(x, t)

    return Denoiser().eval()


def example_inputs(cfg, batch: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    m = cfg.model
    x = torch.randn(batch, m.image_channels, m.image_size, m.image_size, generator=g)
    if cfg.diffusion.objective == "ddpm":
        t = torch.randint(0, cfg.diffusion.num_timesteps, (batch,), generator=g)
    else:  # EDM's and flow's noise input is a float on the timestep embedding's 0..1000 scale
        t = torch.rand(batch, generator=g) * 1000
    if not m.conditional:
        return (x, t)
    return (x, t, torch.randint(0, m.num_classes + 1, (batch,), generator=g))


# The folder an export writes its model file into, inside --out, and checks it in before moving it onto the earlier
# export's (whose export.json describes it): a failed export leaves the earlier one whole. Kept for inspection when
# the file differs from PyTorch; removed by the next export.
STAGING = "export.partial"


def _staged_model(net, cfg, fmt: str, stage: Path, opset: int,
                  labels: dict[str, str]) -> tuple[Path, str, int | None, float | None]:
    """Write the model file of `fmt` into `stage` (an ONNX file with `labels` as its metadata) and check it against
    PyTorch: (its path, which exporter wrote it, the ONNX opset the file declares, the largest difference from
    PyTorch's outputs)."""
    if fmt == "onnx":
        path = stage / "model.onnx"
        with quiet_onnx_exporter():
            exporter, written = _write_onnx(net, cfg, path, opset)
        _label_onnx(path, labels)
        return path, exporter, written, _check_onnx(net, cfg, path)
    path = stage / "model.pt2"
    return path, _export_pt2(net, cfg, path), None, _check_pt2(net, cfg, path)


def _write_onnx(net, cfg, path: Path, opset: int) -> tuple[str, int]:
    import torch

    inputs = example_inputs(cfg, 2)
    names = ["x", "t", "y"][:len(inputs)]
    try:  # the dynamo exporter (torch.export underneath); the TorchScript one where it cannot trace the model
        batch = torch.export.Dim("batch", min=1, max=4096)
        shapes = {"x": {0: batch}, "t": {0: batch}, **({"y": {0: batch}} if len(inputs) == 3 else {})}
        program = torch.onnx.export(net, inputs, dynamo=True, input_names=names, output_names=["eps"],
                                    dynamic_shapes=shapes, opset_version=opset, verbose=False)
        program.save(str(path))
        written = onnx_opset(path)
        if written == opset:
            return "torch.onnx.export(dynamo=True)", written
        # the dynamo exporter writes its own opset (18) when it cannot convert to the one asked for, and says so
        # only in a warning
        first = f"it wrote opset {written}, not {opset}"
    except Exception as e:  # noqa: BLE001 - any exporter failure: try the other one, and say which ran
        first = _first_line(e)
    try:  # its tracer's warnings are answered by _check_onnx (other batch sizes against PyTorch's outputs), and
        # on a failure it dumps the whole TorchScript graph to stdout from C++: both kept from the terminal
        with warnings.catch_warnings(), _fd_stdout_dropped():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            torch.onnx.export(net, inputs, str(path), dynamo=False, input_names=names, output_names=["eps"],
                              dynamic_axes={n: {0: "batch"} for n in [*names, "eps"]}, opset_version=opset)
    except Exception as e:  # noqa: BLE001 - both exporters failed: say what each said
        raise ExportError(f"export --opset {opset}: neither ONNX exporter wrote the model (the dynamo exporter: "
                          f"{first}; the TorchScript one: {_first_line(e)}); try the default --opset 18") from None
    written = onnx_opset(path)
    if written != opset:
        raise ExportError(f"export --opset {opset}: the TorchScript exporter wrote opset {written}; try the default "
                          "--opset 18")
    return f"torch.onnx.export(dynamo=False) (the dynamo exporter: {first})", written


# What torch.onnx.export (torch 2.9) prints on every export, none of it about the model: the torchvision ops it
# would register, a deprecation inside torch's pytree, and the dynamic batch axis that x, t and y share. Matched by
# message, so that any other warning still reaches the user.
_ONNX_NOISE_WARNINGS = ((FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
                        (UserWarning, r"# The axis name: \w+ will not be used, since it shares the same shape"))
_ONNX_NOISE_LOGGER, _ONNX_NOISE_LOG = "torch.onnx._internal.exporter._registration", "torchvision is not installed"
# An --opset other than the dynamo exporter's own (18) is converted by onnxscript, which logs each step of it (and
# a failed conversion's traceback) as warnings: the file's opset is read back and checked instead (_write_onnx)
_ONNX_CONVERSION_LOGGERS = ("onnxscript.version_converter", "torch.onnx._internal.exporter._compat")


@contextlib.contextmanager
def quiet_onnx_exporter():
    """Silence _ONNX_NOISE_WARNINGS, the torchvision log lines and the opset conversion's log for the block;
    everything else still shows."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_ONNX_NOISE_LOG)

    logger = logging.getLogger(_ONNX_NOISE_LOGGER)
    logger.addFilter(keep)
    converters = [logging.getLogger(name) for name in _ONNX_CONVERSION_LOGGERS]
    levels = [c.level for c in converters]
    for c in converters:
        c.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            for category, message in _ONNX_NOISE_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        logger.removeFilter(keep)
        for c, level in zip(converters, levels):
            c.setLevel(level)


@contextlib.contextmanager
def _fd_stdout_dropped():
    """Drop what is written to file descriptor 1 in the block (C++ prints that Python's sys.stdout never sees);
    where there is no descriptor 1 (stdout closed), the block runs as it is."""
    if sys.stdout is not None:
        sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        if sys.stdout is not None:
            sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _label_onnx(path: Path, labels: dict[str, str]) -> None:
    """Add `labels` to the file's metadata_props (onnxruntime's custom_metadata_map). The weights of a large model
    stay in the external file beside it: loaded without them, the graph keeps its references to that file."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for key, value in labels.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))


def schedule_of(cfg) -> dict:
    """What schedule.json holds (and an ONNX file's metadata): the process a sampler needs, the image shape and the
    classes."""
    from fastddpm.diffusion import schedule_from_config

    d = cfg.diffusion
    if d.objective == "ddpm":
        # the float64 betas the schedule derives everything from (its .betas is their float32 copy: 1e-4 as
        # 9.9999997e-05)
        process = {"objective": "ddpm", "betas": schedule_from_config(d).float64("betas").tolist(),
                   "num_timesteps": d.num_timesteps, "schedule": d.schedule, "prediction": d.prediction}
    elif d.objective == "edm":  # Karras et al. 2022, Table 1: x0_hat = c_skip x + c_out F(c_in x, c_noise)
        process = {"objective": "edm", "sigma_data": d.sigma_data, "p_mean": d.edm_p_mean, "p_std": d.edm_p_std,
                   "sigma_min": 0.002, "sigma_max": 80.0, "rho": 7.0,
                   "network_input": "F(x / sqrt(sigma^2 + sigma_data^2), 250 ln(sigma))"}
    else:  # x_t = (1 - t) x0 + t eps; the network predicts v = eps - x0
        process = {"objective": "flow", "shift": d.flow_shift, "t_min": 0.001, "network_input": "v(x_t, 1000 t)",
                   "prediction": "velocity"}
    return {**process,
            "image_shape": [cfg.model.image_channels, cfg.model.image_size, cfg.model.image_size],
            "num_classes": cfg.model.num_classes if cfg.model.conditional else 0,
            "class_names": list(cfg.model.class_names) if cfg.model.conditional else []}


def onnx_opset(path: Path) -> int | None:
    """The default-domain opset an ONNX file declares (what a runtime checks before loading it)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def _check_onnx(net, cfg, path: Path) -> float:
    import numpy as np
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for batch in (1, 3):  # a batch size the export never saw: the axis is dynamic
        inputs = example_inputs(cfg, batch, seed=batch)
        with torch.no_grad():
            want = net(*inputs).numpy()
        feed = {i.name: v.numpy() for i, v in zip(session.get_inputs(), inputs)}
        got = session.run(None, feed)[0]
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


def _export_pt2(net, cfg, path: Path) -> str:
    import torch

    inputs = example_inputs(cfg, 2)
    batch = torch.export.Dim("batch", min=1, max=4096)
    shapes = ({0: batch}, {0: batch}, *([{0: batch}] if len(inputs) == 3 else []))
    program = torch.export.export(net, inputs, dynamic_shapes=shapes)
    torch.export.save(program, str(path))
    return "torch.export.export"


def _check_pt2(net, cfg, path: Path) -> float:
    import torch

    loaded = torch.export.load(str(path)).module()
    worst = 0.0
    for batch in (1, 3):
        inputs = example_inputs(cfg, batch, seed=batch)
        with torch.no_grad():
            worst = max(worst, float((loaded(*inputs) - net(*inputs)).abs().max()))
    return worst


def export(run: str | Path, fmt: str, out: str | Path | None = None, *, opset: int = 18, weights: str = "ema",
           command: str | None = None, eval_results: Sequence[str | Path] = (), log=print) -> dict:
    """Export RUN (run directory, checkpoint or ema.safetensors) as `fmt`, its EMA or raw ("model") `weights`;
    `eval_results`: `fastddpm eval` result files (or folders of them) the card may quote besides the run's own
    (export_card.result_files). Returns what export.json records."""
    import torch

    from fastddpm.config import ConfigError, save_config
    from fastddpm.export_card import eval_of_these_weights, fid_of_these_weights, model_card
    from fastddpm.rundir.files import save_safetensors
    from fastddpm.rundir.locate import EMA_EXPORT_FORMAT, WEIGHTS_LABELS, locate
    from fastddpm.rundir.metrics import read_metrics
    from fastddpm.rundir.state_dicts import weights_digest
    from fastddpm.sampling import load_for_sampling

    if fmt not in FORMATS:
        raise ConfigError(f"export: format {fmt!r} is not one of {', '.join(FORMATS)}")
    if weights not in WEIGHTS_LABELS:
        raise ConfigError(f"export: weights {weights!r} is not one of {', '.join(WEIGHTS_LABELS)} (EMA or raw)")
    for given in eval_results:  # before the weights are read: a misspelt path would only leave the FID out
        if not Path(given).exists():
            raise ConfigError(f"export --eval-results {given}: no such file or folder; give a result fastddpm eval "
                              "wrote (its .json, in RUN_DIR/eval/ or eval's --out) or the folder that holds it")
    ckpt = locate(run, weights=weights, what="export:")
    if fmt == "diffusers":
        from fastddpm.diffusers_io import check_exportable

        check_exportable(ckpt.config)  # before loading the weights or writing anything
    if fmt == "onnx":
        try:
            import onnx  # checked here, before anything is written
            import onnxruntime  # noqa: F401
        except ImportError:
            raise ConfigError("export --format onnx checks the file in onnxruntime: pip install onnx onnxruntime "
                              "onnxscript (or pip install 'fastddpm[onnx]')") from None
        # an opset onnx does not know, no exporter writes: refused before both exporters are tried (minutes)
        if not 1 <= opset <= onnx.defs.onnx_opset_version():
            raise ConfigError(f"export --opset {opset}: the installed onnx knows opsets 1 to "
                              f"{onnx.defs.onnx_opset_version()}; give one of those (default 18)")
    model, cfg = load_for_sampling(ckpt, device="cpu", weights=weights)  # raw weights of an ema.safetensors: refused
    digest = weights_digest(model)  # as loaded, as `fastddpm eval` digests them: the card finds its results by it
    info, run_dir = {**ckpt.info(), "weights": weights}, ckpt.run_dir
    out = Path(out) if out is not None else run_dir.export(fmt)
    check_out_dir(out)
    make_out_dir(out)
    evals = [r for r in read_metrics(run_dir.metrics) if r.get("event") == "eval"] \
        if run_dir.metrics.is_file() else []
    # the FIDs measured of these weights, which every format's card quotes: the run's own, and `fastddpm eval`'s
    fid = fid_of_these_weights(evals, info)
    evaluated = eval_of_these_weights(run_dir, digest, info, extra=eval_results)
    if eval_results and evaluated is None:
        log(f"note: --eval-results {' '.join(map(str, eval_results))}: no result there (nor in the run's eval/) is of "
            "these weights with a finite FID, so the card quotes none; `fastddpm eval` of this checkpoint measures it")
    if fmt == "diffusers":
        return _export_diffusers(model.float(), cfg, info, out, command or f"fastddpm.export.export({str(run)!r}, "
                                 f"{fmt!r})", log, fid=fid, evaluated=evaluated)
    net = _denoiser(model.float(), cfg.model.conditional)
    result = {"format": fmt, "checkpoint": info, "max_abs_diff": None, "tolerance": TOLERANCE}
    schedule = schedule_of(cfg)
    # what an ONNX file carries of its own, so that it samples where it goes without its folder (sample_onnx.py)
    labels = {"fastddpm.schedule": json.dumps(schedule), "fastddpm.config": json.dumps(cfg.to_dict()),
              "fastddpm.weights": weights, "fastddpm.step": str(info.get("step")),
              "fastddpm.images_seen": str(info.get("images_seen"))}
    if fmt in ("onnx", "torch-export"):
        stage = out / STAGING
        shutil.rmtree(stage, ignore_errors=True)  # a killed or failed export's
        stage.mkdir()
        try:
            staged, result["exporter"], opset_written, result["max_abs_diff"] = _staged_model(net, cfg, fmt, stage,
                                                                                             opset, labels)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        if fmt == "onnx":
            result["opset"] = opset_written
        if not result["max_abs_diff"] <= TOLERANCE:
            raise ExportError(f"export: the exported model differs from PyTorch by {result['max_abs_diff']:.3g} "
                              f"(more than {TOLERANCE:g}) on the same inputs, so {out} keeps what it held; the "
                              f"file is kept for inspection as {staged}. Another format (--format torch-export or "
                              "safetensors) or, for ONNX, another --opset may export it exactly")
        if fmt == "onnx" and not (stage / "model.onnx.data").exists():  # an earlier, larger model's weights
            (out / "model.onnx.data").unlink(missing_ok=True)
        for name in sorted(p.name for p in stage.iterdir()):  # the model and its external weights, if any
            os.replace(stage / name, out / name)
        stage.rmdir()
        path = out / staged.name
    else:
        path = out / "model.safetensors"
        save_safetensors({k: v.contiguous() for k, v in model.state_dict().items()}, path,
                         {"config": cfg.to_dict(), "step": info.get("step"), "images_seen": info.get("images_seen"),
                          "format": EMA_EXPORT_FORMAT, "weights": weights})
        result["exporter"] = "safetensors (the U-Net's state_dict; build fastddpm.models.build_unet(config.model))"
    (out / "schedule.json").write_text(json.dumps(schedule, indent=1) + "\n")
    save_config(cfg, out / "config.json")
    command = command or f"fastddpm.export.export({str(run)!r}, {fmt!r})"
    files = [path.name, "schedule.json", "config.json", "README.md"]
    if fmt == "onnx":  # the folder samples wherever it goes, with no fastddpm installed
        shutil.copyfile(Path(__file__).with_name("sample_onnx.py"), out / "sample_onnx.py")
        files.append("sample_onnx.py")
    (out / "README.md").write_text(model_card(cfg, info, fid, fmt, files, command, evaluated=evaluated))
    result.update(out=str(Path(out).absolute()), files=files, torch=torch.__version__)
    removed = remove_other_exports(out, files)
    (out / "export.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    diff = "" if result["max_abs_diff"] is None else f"; max |difference| vs PyTorch {result['max_abs_diff']:.2e}"
    log(f"exported {path} ({result['exporter']}){diff}; wrote {out}/{', '.join(files[1:])}"
        + removed_note(removed))
    return result


# what an export writes (model.onnx.data: the ONNX exporter's external weights of a large model)
_MODEL_FILES = {"model.onnx", "model.pt2", "model.safetensors", "unet"}
_EXPORT_NAMES = _MODEL_FILES | {"model.onnx.data", STAGING, "sample_onnx.py", "schedule.json", "config.json",
                                "README.md", "export.json", "scheduler", "model_index.json"}


def check_out_dir(out: Path) -> None:
    """Refuse a --out that is a file, or a folder holding files an export did not write (`--out .` would
    replace the project's own README.md and config.json). An earlier export's folder is written over, finished
    (export.json) or not (a model file and only an export's names: the retry of a failed one)."""
    from fastddpm.config import ConfigError

    if out.exists() and not out.is_dir():
        raise ConfigError(f"export --out {out} is a file: give a folder (new, empty, or an earlier export's)")
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    exported = "export.json" in names or (names <= _EXPORT_NAMES and bool(names & (_MODEL_FILES | {STAGING})))
    if names and not exported:
        # without a model file, even an export's names (README.md, config.json) may be a project's own
        found = sorted(names - _EXPORT_NAMES) or sorted(names)
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(f"export --out {out} holds files an export did not write ({shown}): a folder of other "
                          "files may have its own README.md, config.json or schedule.json, which an export would "
                          "replace, so export into a new, empty or earlier export's folder instead, e.g. --out "
                          f"{out / 'export'}")


def remove_other_exports(out: Path, written: list[str]) -> list[str]:
    """Remove what an earlier export in another format left in `out` (model.onnx beside a new model.safetensors,
    a diffusers unet/ beside a new model.pt2), so that the folder holds one export and its card describes every
    model file in it. Only names an export writes, never a user's own files; called once the new export is
    written and checked, so a failed export leaves the earlier one whole. Returns the names removed."""
    keep = {Path(f).parts[0] for f in written} | {"export.json"}
    if "model.onnx" in keep:
        keep.add("model.onnx.data")  # the ONNX exporter's external weights of a large model
    removed = []
    for name in sorted(_EXPORT_NAMES - keep):
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def removed_note(removed: list[str]) -> str:
    """The log's account of remove_other_exports: what went, why, and how to have kept it."""
    if not removed:
        return ""
    return (f"; removed the earlier export's {', '.join(removed)} (a folder holds one export, the one its README.md "
            "and export.json describe; to keep both, give each format its own --out, as the default "
            "RUN_DIR/export-<format> does, and export the earlier one again)")


def make_out_dir(out: Path) -> None:
    """Create --out before any exporter runs: the ONNX exporters' failures to write are caught as failures to
    convert, and would be blamed on the opset."""
    from fastddpm.rundir.files import make_writable_dir

    make_writable_dir(out, flag="export --out", fix="give a folder that can be created and written, new, empty or "
                                                    "an earlier export's")


def _export_diffusers(model, cfg, info: dict, out: Path, command: str, log, *, fid: dict | None,
                      evaluated: dict | None) -> dict:
    import torch

    from fastddpm import diffusers_io

    files = diffusers_io.write_folder(model, cfg, out)
    (out / "README.md").write_text(diffusers_io.model_card(cfg, info, command, fid=fid, evaluated=evaluated))
    files.append("README.md")
    result = {"format": "diffusers", "checkpoint": info, "exporter": "fastddpm.diffusers_io (UNet2DModel, "
              "DDPMScheduler, DDPMPipeline)", "max_abs_diff": diffusers_io.check_folder(model, cfg, out),
              "tolerance": diffusers_io.TOLERANCE, "out": str(out.absolute()), "files": files,
              "torch": torch.__version__}
    if result["max_abs_diff"] is not None and not result["max_abs_diff"] <= diffusers_io.TOLERANCE:
        raise ExportError(f"export: diffusers' UNet2DModel from {out / 'unet'} differs from fastddpm's model by "
                          f"{result['max_abs_diff']:.3g} (more than {diffusers_io.TOLERANCE:g}) on the same inputs; "
                          "the folder is kept for inspection")
    removed = remove_other_exports(out, files)
    (out / "export.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    diff = ("; diffusers is not installed here, so the folder was not loaded back" if result["max_abs_diff"] is None
            else f"; max |difference| of diffusers' UNet2DModel vs fastddpm {result['max_abs_diff']:.2e}")
    log(f"exported {out} for diffusers (DDPMPipeline.from_pretrained){diff}" + removed_note(removed))
    return result


def run_export(args: argparse.Namespace) -> int:
    from fastddpm.config import ConfigError

    if args.opset is not None and args.format != "onnx":
        raise ConfigError(f"export --opset {args.opset} applies to --format onnx only; drop it for --format "
                          f"{args.format}")
    command = f"fastddpm export {shlex.quote(str(args.run))} --format {args.format}" + (
        f" --out {shlex.quote(str(args.out))}" if args.out else "") + (
        f" --opset {args.opset}" if args.opset is not None else "") + (
        f" --weights {args.weights}" if args.weights != "ema" else "") + "".join(
        f" --eval-results {shlex.quote(p)}" for p in args.eval_results)
    try:
        export(args.run, args.format, args.out, opset=18 if args.opset is None else args.opset,
               weights=args.weights, command=command, eval_results=args.eval_results)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
