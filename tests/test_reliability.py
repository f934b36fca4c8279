"""Faults the trainer must survive without losing anything (see RELIABILITY.md in the shared docs)."""

import copy
import pytest
import torch

from fastddpm.cli import main
from fastddpm.config import get_preset
from fastddpm.diffusion import make_schedule
from fastddpm.models import UNet
from fastddpm.train import batches as batches_mod
from fastddpm.train.batches import Batch, ResidentBatches
from fastddpm.train.ema import EMA
from fastddpm.train.runtime import resolve_precision
from fastddpm.train.step import TrainStep, make_optimizer

CPU = torch.device("cpu")


def _poisoned(batch: Batch) -> Batch:
    noise = batch.noise.clone()
    noise[0, 0, 0, 0] = float("nan")
    return Batch(x0=batch.x0, t=batch.t, noise=noise, indices=batch.indices)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach-cpu-path", "fused-device-path"])
def test_non_finite_loss_skips_the_update_and_keeps_the_last_finite_weights(fused):
    from conftest import read_fmnist

    images = read_fmnist(64)[0]
    cfg = get_preset("tiny").model
    cfg.image_channels, cfg.image_size = 1, 28
    torch.manual_seed(0)
    model = UNet(cfg)
    opt = make_optimizer(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, device=CPU, tensor_lr=fused,
                         capturable=False)
    assert bool(opt.param_groups[0].get("fused")) == fused
    ema = EMA(model, 0.99)
    step = TrainStep(model=model, optimizer=opt, scaler=None, ema=ema, schedule=make_schedule("linear", 1000),
                     prediction="epsilon", precision=resolve_precision("fp32", CPU), grad_clip=1.0, device=CPU)
    source = ResidentBatches(images, batch_size=16, num_timesteps=1000, seed=0, device=CPU)
    for s in range(3):
        step([source.get(s)], lr=1e-3, step=s)
    assert step.first_bad_step() is None
    params = copy.deepcopy(model.state_dict())
    ema_params = copy.deepcopy(ema.state_dict())
    opt_steps = [st["step"].clone() for st in opt.state.values()]

    loss = step([_poisoned(source.get(3))], lr=1e-3, step=3)
    assert not torch.isfinite(loss)
    step([source.get(4)], lr=1e-3, step=4)  # finite again, but the run is already marked: still skipped
    assert step.first_bad_step() == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    for k, v in ema.state_dict().items():
        assert torch.equal(v, ema_params[k]), k
    assert all(torch.equal(st["step"], s0) for st, s0 in zip(opt.state.values(), opt_steps))


def test_run_with_a_nan_stops_naming_the_step(tmp_path, fmnist_npz, monkeypatch, capsys):
    real_get = ResidentBatches.get

    def get(self, m):
        batch = real_get(self, m)
        return _poisoned(batch) if m == 5 else batch

    monkeypatch.setattr(batches_mod.ResidentBatches, "get", get)
    run = tmp_path / "run"
    code = main(["train", "--data", str(fmnist_npz), "--out", str(run), "--preset", "tiny", "--max-steps", "20",
                 "--log-every", "10", "--checkpoint-every", "4", "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err
    assert "NaN/Inf at step 6" in err and "keep their values from step 5" in err and "ckpt_000000004.pt" in err
    # stopped at once on the CPU: before its first logging step, with the step-4 checkpoint intact
    assert not (run / "metrics.jsonl").exists()
    from fastddpm.train.checkpoint import list_checkpoints, load_checkpoint

    (ckpt,) = list_checkpoints(run / "checkpoints")
    state = load_checkpoint(ckpt)
    assert state["step"] == 4 and all(torch.isfinite(v).all() for v in state["model"].values())
