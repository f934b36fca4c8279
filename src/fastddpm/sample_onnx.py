"""Sample from a `fastddpm export --format onnx` folder with onnxruntime and numpy alone: no torch, no fastddpm.

Every ONNX export folder holds a copy of this file, so the folder samples wherever it is copied or uploaded:

    cd EXPORT_DIR && python sample_onnx.py . [--num 64] [--steps 20] [--seed 0] [--class NAME|ID [--guidance W]]
                                            [--batch-size 256] [--out onnx_samples.png]

(or `python sample_onnx.py path/to/model.onnx ...`: the file carries schedule.json and config.json in its
metadata, for a model.onnx that travels without its folder; the folder's files, where present, come first)

(with fastddpm installed, `python -m fastddpm.sample_onnx EXPORT_DIR ...` is the same). DDIM (Song et al. 2021,
eta = 0) over `--steps` trailing timesteps of schedule.json's betas, or for an EDM or flow-matching export Euler's
method over its levels (the same update, x' = alpha' x0_hat + sigma' eps_hat). A conditional model draws class
`--class` (a name or an id from schedule.json's class_names; default: none, i.e. unconditional) with
classifier-free guidance at scale `--guidance` W (default: the run's train.sample_guidance from config.json, as
`fastddpm sample`; 1 where it records none): out = out(y = null) + W (out(y) - out(y = null)), the null class
being id num_classes. The images are drawn `--batch-size` at a time from noise drawn for all of them first, so the
batch size does not change them. The grid is written as a PNG by the few lines of zlib below.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import onnxruntime as ort

MAX_BATCH = 4096  # the export's batch axis: torch.export.Dim("batch", min=1, max=4096) in fastddpm.export
GRID_IMAGES = 256  # the grid's: as `fastddpm sample`'s; the .npz holds every image


def trailing(T: int, steps: int) -> np.ndarray:
    """`steps` timesteps from T - 1 down, evenly spaced (trailing spacing, Lin et al. 2024, table 2), as fastddpm
    and diffusers compute them; only the first `steps`: np.arange(T, 0, -T / steps) gains a step, t = -1, where the
    float stride falls short."""
    if not 1 <= steps <= T:
        raise SystemExit(f"--steps {steps}: between 1 and the model's {T} timesteps")
    return np.round(np.arange(T, 0, -T / steps))[:steps].astype(np.int64) - 1


def network(session: ort.InferenceSession, num: int, label: int | None, guidance: float, null_class: int, *,
            conditional: bool):
    """The model as the samplers call it, f(x (N, C, H, W) float32, t (N,)) -> its output as float64, with the class
    and the guidance folded in as in fastddpm.diffusion.guidance: one call of the 2N batch [x; x] with labels
    [label; null] when W is neither 0 nor 1. `conditional`: the model takes the class input y."""

    def run(x, t, y):
        feed = {"x": x, "t": t, **({"y": y} if conditional else {})}
        return session.run(None, feed)[0].astype(np.float64)

    if label is None or guidance in (0.0, 1.0):
        y = np.full(num, null_class if label is None or guidance == 0.0 else label, dtype=np.int64)
        return lambda x, t: run(x, t, y)
    both = np.concatenate([np.full(num, label), np.full(num, null_class)]).astype(np.int64)

    def guided(x, t):
        cond, uncond = np.split(run(np.concatenate([x, x]), np.concatenate([t, t]), both), 2)
        return uncond + guidance * (cond - uncond)

    return guided


def ddim(net, schedule: dict, x: np.ndarray, steps: int) -> np.ndarray:
    """Images as float32 (N, C, H, W) in [-1, 1] from the noise x_T `x` (N, C, H, W); `net` as `network` returns
    it for N images."""
    alpha_bar = np.cumprod(1.0 - np.asarray(schedule["betas"], dtype=np.float64))
    ts = trailing(schedule["num_timesteps"], steps)
    x, num = x.astype(np.float32), len(x)
    for i, t in enumerate(ts):
        out = net(x, np.full(num, t, dtype=np.int64))
        a, a_prev = alpha_bar[t], (alpha_bar[ts[i + 1]] if i + 1 < len(ts) else 1.0)
        if schedule["prediction"] == "v":  # v = sqrt(a) eps - sqrt(1 - a) x0
            x0 = np.sqrt(a) * x - np.sqrt(1 - a) * out
        else:
            x0 = (x - np.sqrt(1 - a) * out) / np.sqrt(a)
        x0 = np.clip(x0, -1.0, 1.0)
        eps = (x - np.sqrt(a) * x0) / np.sqrt(1 - a)  # consistent with the clipped x0
        x = (np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev) * eps).astype(np.float32)
    return x


def continuous_levels(schedule: dict, steps: int) -> list[float]:
    """The noise levels of an EDM export (sigma, Karras et al. 2022 eq. 5) or a flow export (t, evenly from 1 then
    shifted, as diffusers' FlowMatchEulerDiscreteScheduler), noisiest first; sampling ends at level 0."""
    frac = np.linspace(0.0, 1.0, steps) if steps > 1 else np.zeros(1)
    if schedule["objective"] == "edm":
        rho = schedule["rho"]
        hi, lo = schedule["sigma_max"] ** (1 / rho), schedule["sigma_min"] ** (1 / rho)
        return list((hi + frac * (lo - hi)) ** rho)
    s = schedule["shift"]
    shift = lambda t: s * t / (1 + (s - 1) * t)  # noqa: E731
    return [shift(t) for t in 1.0 + frac * (shift(schedule["t_min"]) - 1.0)]


def euler(net, schedule: dict, noise: np.ndarray, steps: int) -> np.ndarray:
    """EDM (x = x0 + sigma eps, x0_hat = c_skip x + c_out F(c_in x, 250 ln sigma)) or flow matching
    (x = (1 - t) x0 + t eps, x0_hat = x - t v(x, 1000 t)): images as float32 (N, C, H, W) in [-1, 1] from unit
    Gaussian `noise` (N, C, H, W)."""
    levels = continuous_levels(schedule, steps)
    edm = schedule["objective"] == "edm"
    alpha = [1.0 if edm else 1.0 - v for v in levels] + [1.0]
    sigma = list(levels) + [0.0]
    num = len(noise)
    x = sigma[0] * noise.astype(np.float64)
    for i, level in enumerate(levels):
        if edm:
            sd = schedule["sigma_data"]
            norm = np.sqrt(level**2 + sd**2)
            c_skip, c_out, c_in = sd**2 / norm**2, level * sd / norm, 1 / norm
            out = net((c_in * x).astype(np.float32), np.full(num, 250 * np.log(level), dtype=np.float32))
        else:
            out = net(x.astype(np.float32), np.full(num, 1000 * level, dtype=np.float32))
        x0 = np.clip(c_skip * x + c_out * out if edm else x - level * out, -1.0, 1.0)
        eps = (x - alpha[i] * x0) / sigma[i]
        x = alpha[i + 1] * x0 + sigma[i + 1] * eps
    return x.astype(np.float32)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> uint8 (N, C, H, W), as fastddpm writes its samples."""
    return np.clip(np.round((images + 1) * 127.5), 0, 255).astype(np.uint8)


def grid_uint8(u8: np.ndarray, nrow: int, pad: int = 2) -> np.ndarray:
    """uint8 (N, C, H, W) -> one (rows, cols, C) uint8 image, `nrow` per row."""
    n, c, h, w = u8.shape
    rows = -(-n // nrow)
    out = np.zeros((rows * (h + pad) + pad, nrow * (w + pad) + pad, c), dtype=np.uint8)
    for k, im in enumerate(u8.transpose(0, 2, 3, 1)):
        r, q = divmod(k, nrow)
        out[pad + r * (h + pad):pad + r * (h + pad) + h, pad + q * (w + pad):pad + q * (w + pad) + w] = im
    return out


def write_png(path: Path, image: np.ndarray) -> None:
    """8-bit grey (C = 1) or RGB (C = 3) PNG: signature, IHDR, one zlib IDAT of unfiltered rows, IEND."""
    h, w, c = image.shape
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = b"".join(b"\x00" + image[r].tobytes() for r in range(h))
    header = struct.pack(">IIBBBBB", w, h, 8, 0 if c == 1 else 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                     + chunk(b"IEND", b""))


def class_id(schedule: dict, wanted: str) -> int:
    """The id `--class` names: a class name (case-insensitive) or a number, as `fastddpm sample --class`."""
    names, n = schedule.get("class_names") or [], schedule.get("num_classes", 0)
    if not n:
        raise SystemExit(f"--class {wanted}: this export's model is unconditional (trained without --conditional); "
                         "sample without --class")
    valid = ", ".join(f"{i} {name!r}" for i, name in enumerate(names)) or f"ids 0-{n - 1}"
    for i, name in enumerate(names):
        if name.lower() == wanted.strip().lower():
            return i
    if wanted.strip().lstrip("-").isdigit():
        if 0 <= int(wanted) < n:
            return int(wanted)
        raise SystemExit(f"--class {wanted} is out of range: this model has classes 0-{n - 1} ({valid})")
    raise SystemExit(f"--class {wanted!r} is not one of this model's classes: {valid} (a name or its number)")


def folder_or_model_json(model: Path, session: ort.InferenceSession, name: str) -> dict | None:
    """`name`.json beside the model file (the export folder's, which a user may edit: class names), else the same
    JSON from the file's own metadata (fastddpm.`name`: the model file alone, away from its folder), else None."""
    beside = model.parent / f"{name}.json"
    if beside.is_file():
        return json.loads(beside.read_text())
    carried = session.get_modelmeta().custom_metadata_map.get(f"fastddpm.{name}")
    return None if carried is None else json.loads(carried)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export_dir", type=Path, metavar="EXPORT_DIR|MODEL.onnx",
                   help="the export folder, or a model.onnx alone (its metadata holds schedule.json and config.json)")
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--class", dest="label", metavar="NAME|ID", default=None)
    p.add_argument("--guidance", type=float, default=None, metavar="W")
    p.add_argument("--batch-size", type=int, default=256, metavar="B",
                   help="images per onnxruntime call (guided: 2B; the export takes at most 4096)")
    p.add_argument("--out", type=Path, default=Path("onnx_samples.png"),
                   help="the grid (up to 256 images); every image goes to the .npz beside it")
    args = p.parse_args(argv)
    if args.num < 1 or args.steps < 1:
        raise SystemExit(f"--num {args.num} and --steps {args.steps} must both be >= 1")
    if args.seed < 0:  # numpy's generator takes none: it ended in a ValueError traceback, after the model loaded
        raise SystemExit(f"--seed {args.seed}: the noise's seed is a whole number >= 0, e.g. --seed {-args.seed}")
    if args.out.suffix.lower() != ".png" and not args.out.is_dir():  # a folder is refused below, naming a file in it
        # written as a PNG whatever its name: `--out model.onnx` or `--out config.json` replaced that file
        raise SystemExit(f"--out {args.out}: the grid is a PNG (the images go to the .npz of the same name), and this "
                         f"name does not end in .png, so a file there (an export's model.onnx, a run's config.json) "
                         f"would be replaced: give a name ending in .png, e.g. --out {args.out.with_suffix('.png')}")
    model = args.export_dir if args.export_dir.suffix == ".onnx" and args.export_dir.is_file() else \
        args.export_dir / "model.onnx"
    if not model.is_file():
        raise SystemExit(f"{args.export_dir} holds no model.onnx: give the folder of a `fastddpm export --format "
                         "onnx` or its model.onnx (its README.md says how to sample an export of another format)")
    try:  # before the grid's folder is made: a file that does not load leaves nothing behind
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own error classes (InvalidProtobuf, Fail, ...) live in its C++ module
        raise SystemExit(f"{model}: onnxruntime cannot load it ({str(e).strip() or type(e).__name__}): export it "
                         "again with fastddpm export --format onnx") from None
    schedule, config = folder_or_model_json(model, session, "schedule"), folder_or_model_json(model, session, "config")
    conditional = "y" in [i.name for i in session.get_inputs()]  # the class input: a conditional model's export
    if schedule is None:
        raise SystemExit(f"{model} has no schedule.json beside it and carries none in its metadata (an export older "
                         "than the metadata): sample it in its export folder, or export it again")
    run_guidance = (config or {}).get("train", {}).get("sample_guidance")
    label = None if args.label is None else class_id(schedule, args.label)
    if args.guidance is not None and label is None:
        raise SystemExit("--guidance steers toward a class: give --class NAME|ID with it")
    guidance = args.guidance if args.guidance is not None else run_guidance if run_guidance is not None else 1.0
    if not (math.isfinite(guidance) and guidance >= 0):
        raise SystemExit(f"--guidance {guidance:g} must be a finite number >= 0 (1: plain conditional, 0: "
                         "unconditional)")
    most = MAX_BATCH // 2 if label is not None and guidance not in (0.0, 1.0) else MAX_BATCH
    if not 1 <= args.batch_size <= most:
        doubled = ", and a guided call doubles the batch" if most < MAX_BATCH else ""
        raise SystemExit(f"--batch-size {args.batch_size}: between 1 and {most} (the export's batch axis takes at "
                         f"most {MAX_BATCH} images{doubled})")
    try:  # the grid's folder, before any sampling
        args.out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {args.out}: cannot create its folder {args.out.parent} ({e.strerror or e}): give a "
                         "path in a folder that can be created and written") from None
    if args.out.is_dir():
        raise SystemExit(f"--out {args.out} is a folder: give the grid's file name, e.g. {args.out / 'samples.png'}")
    sampler = ddim if schedule.get("objective", "ddpm") == "ddpm" else euler
    noise = np.random.default_rng(args.seed).standard_normal((args.num, *schedule["image_shape"]))
    images = to_uint8(np.concatenate([
        sampler(network(session, len(chunk), label, guidance, schedule.get("num_classes", 0), conditional=conditional),
                schedule, chunk, args.steps)
        for chunk in np.split(noise, range(args.batch_size, args.num, args.batch_size))]))
    shown = images[:GRID_IMAGES]
    write_png(args.out, grid_uint8(shown, nrow=int(np.ceil(np.sqrt(len(shown))))))
    npz = args.out.with_suffix(".npz")
    np.savez(npz, images=images, **({} if label is None else {"labels": np.full(args.num, label, dtype=np.int64),
                                                               "guidance": np.float64(guidance)}))
    classes = schedule.get("num_classes", 0)
    drawn = (f", class {label} at guidance W = {guidance:g}" if label is not None else
             f", unconditional (the null class; --class NAME|ID draws one of the model's {classes} classes, guided at "
             f"W = {guidance:g})" if conditional else "")
    print(f"wrote {args.out} ({len(shown)} images) and {npz} (all {args.num}, uint8 (N, C, H, W)){drawn}, "
          f"{sampler.__name__.upper()} {args.steps} steps, onnxruntime {ort.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
