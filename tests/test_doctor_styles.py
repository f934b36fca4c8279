"""The doctor on training-loop styles common in diffusion repos: an EMA of the weights updated by a Python loop
over the parameters after the optimizer step is seen and costed (rule 23), its fix is a foreach update, and it is
not mistaken for a per-sample loop (rule 22) nor left to torch.compile of the model (rule 18); a loop that
accumulates gradients over several batches from a DataLoader built in its `for` statement has its loader probed
against all the batches a step takes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import torch

EMA_SCRIPT = textwrap.dedent("""
    import copy
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Denoiser(nn.Module):  # an MLP denoiser of 2-D toy data: many weights, little arithmetic per step
        def __init__(self, d=512, depth=6):
            super().__init__()
            self.inp = nn.Linear(3, d)
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.SiLU())
                                        for _ in range(depth))
            self.out = nn.Linear(d, 2)

        def forward(self, x, t):
            h = self.inp(torch.cat([x, t[:, None]], 1))
            for block in self.blocks:
                h = h + block(h)
            return self.out(h)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # steady on a loaded machine: two threads wait on each other's stragglers
    model = Denoiser()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)
    data = torch.randn(4096, 2)
    decay = 0.999
    for step in range(100000):
        x0 = data[torch.randint(0, len(data), (8,))]
        t = torch.randint(0, 1000, (8,))
        noise = torch.randn_like(x0)
        a = abar[t][:, None]
        loss = F.mse_loss(model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t / 1000), noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            UPDATE
""")
# as diffusers' EMAModel.step writes it without foreach (its default)
PER_TENSOR = """for s_param, param in zip(ema.parameters(), model.parameters()):
                s_param.sub_((1 - decay) * (s_param - param))"""
FOREACH = "torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)"


def _run(tmp_path, update: str, script: str = EMA_SCRIPT) -> tuple[dict, str]:
    """`fastddpm doctor run` on the script with `update` as its EMA step, in a fresh process (the script runs on
    one thread, steady on a loaded machine, and its thread count must not leak into this one's later tests):
    (report.json, report.txt)."""
    path, rep = tmp_path / "train.py", tmp_path / "rep"
    path.write_text(script.replace("UPDATE", update))
    subprocess.run([sys.executable, "-m", "fastddpm", "doctor", "run", "--warmup", "2", "--steps", "3",
                    "--profile-steps", "5", "--loader-probe-s", "0", "--max-seconds", "0", "--device", "cpu",
                    "--report-dir", str(rep), str(path)], check=True, capture_output=True, text=True)
    return json.loads((rep / "report.json").read_text()), (rep / "report.txt").read_text()


def _run_in_process(tmp_path, script: str, try_fixes: int) -> tuple[dict, str]:
    """`_run` with `--try`, in this process (as `fastddpm doctor run` runs it), its trials one round whatever the
    machine's load (the command line bounds them by time only): what a fix does is checked here, what it gains is
    measured by benchmarks/doctor_emamodel_try.py (benchmarks/RESULTS.md); the thread count put back."""
    from fastddpm.doctor import DoctorConfig
    from fastddpm.doctor.runners import run_script

    path, rep = tmp_path / "train.py", tmp_path / "rep"
    path.write_text(script)
    cfg = DoctorConfig(warmup_steps=2, steps=3, profile_steps=5, loader_probe_s=0, out_dir=rep, time_budget_s=None)
    threads = torch.get_num_threads()
    try:
        run_script(path, [], cfg, device="cpu", try_fixes=try_fixes, try_rounds=1, try_seconds=None,
                   log=lambda *a: None)
    finally:
        torch.set_num_threads(threads)
    return json.loads((rep / "report.json").read_text()), (rep / "report.txt").read_text()


def _finding(report: dict, finding_id: str) -> dict | None:
    return next((f for f in report["findings"] if f["id"] == finding_id), None)


def test_a_per_parameter_ema_loop_is_costed_and_its_fix_is_a_foreach_update(tmp_path):
    """The EMA's sub_ on each of the 28 parameter tensors (fed by a sub and a mul each) is one run of updates
    outside the optimizer, writing the parameters' elements; the finding's fix is torch._foreach_lerp_, not the
    per-sample loop's batched op, and the model's torch.compile is not counted to fuse them."""
    report, text = _run(tmp_path, PER_TENSOR)
    loop = report["measurements"]["trace"]["param_update_loop"]
    params = report["measurements"]["optimizer"]["param_count"]
    assert loop["updates"] == 28 and loop["elements"] == params
    assert loop["per_tensor_ops"] == ["aten::sub_"]
    finding = _finding(report, "per-tensor-ema")
    assert finding is not None, text
    assert finding["rules"] == [23] and finding["group"] == "compute"
    assert "28 in-place updates (sub_) one tensor at a time" in finding["evidence"][0]
    # the place: the loop's line, as the script has it, counted once in a warm-up step by a TorchFunctionMode
    line = 1 + EMA_SCRIPT.replace("UPDATE", PER_TENSOR).splitlines().index(
        "                s_param.sub_((1 - decay) * (s_param - param))")
    assert report["measurements"]["update_site"] == {
        "place": f"train.py:{line}", "code": "s_param.sub_((1 - decay) * (s_param - param))", "updates": 28}
    assert f"outside the optimizer, made at train.py:{line} (`s_param.sub_((1 - decay) * (s_param - param))`)" \
        in finding["evidence"][0]
    assert f"in place of the loop at train.py:{line}, the two lists" in finding["fixes"][0]["code"]
    assert "(1.0x the optimizer's" in finding["evidence"][0]
    assert "over the 28 parameter tensors after the optimizer step issues sub_ for every tensor" \
        in finding["cause"]
    assert finding["fixes"][0]["code"].startswith("with torch.no_grad(): torch._foreach_lerp_(ema_params, "
                                                  "model_params, 1 - decay) in place of the loop")
    # the fix where the finding makes the verdict or ranks among its compute fixes, else its title
    assert "torch._foreach_lerp_(ema_params" in text or "PER-TENSOR EMA" in text
    assert _finding(report, "item-loop") is None  # zip over parameters is not x[i] over the batch
    elementwise = _finding(report, "eager-elementwise")
    if elementwise is not None:  # what is left for compile excludes the EMA's own ops
        breakdown = report["measurements"]["trace"]["breakdown"]
        ema_ops = loop["ops_us"] / loop["step_us"]
        assert elementwise["cost"] <= 0.3 * (breakdown["elementwise"] + breakdown["norm"] - ema_ops) + 0.05


def test_diffusers_emamodel_updated_per_tensor_is_fixed_by_its_own_foreach_argument_and_try_measures_it(tmp_path):
    """A script that keeps its EMA in diffusers' EMAModel (foreach=False by default) is told to pass foreach=True
    where it builds it, not to write torch._foreach_lerp_ into a library's step it does not own; --try runs the
    unchanged script with EMAModel built foreach=True against it. Here the EMA steps over 196 small tensors (a
    48-block MLP of width 32): benchmarks/doctor_emamodel_try.py measured 1.17-1.25x against 1.10-1.11x predicted
    on this script (benchmarks/RESULTS.md); the test checks the trial runs the fix and reports against the
    finding's prediction."""
    pytest.importorskip("diffusers")
    script = EMA_SCRIPT.replace("ema = copy.deepcopy(model).requires_grad_(False)",
                                "from diffusers.training_utils import EMAModel\n"
                                "ema = EMAModel(model.parameters(), decay=0.999)")
    script = script.replace("model = Denoiser()", "model = Denoiser(d=32, depth=48)")
    line = script.splitlines().index("ema = EMAModel(model.parameters(), decay=0.999)") + 1
    report, text = _run_in_process(tmp_path, script.replace("UPDATE", "ema.step(model.parameters())"), try_fixes=1)
    finding = _finding(report, "per-tensor-ema")
    assert finding is not None, text
    assert finding["fixes"][0]["code"] == (f"EMAModel(..., foreach=True) at train.py:{line} (now foreach=False): its "
                                           "step then updates every tensor in a few torch._foreach ops")
    assert any(f.startswith("diffusers ") and f"EMAModel() at train.py:{line}" in f
               for f in report["script"]["frameworks"])
    assert finding["fixes"][0]["trial"] == "foreach-ema"
    # the updates run in diffusers' step: their place is the script's line that calls it
    step_line = 1 + [s.strip() for s in script.splitlines()].index("UPDATE")
    assert report["measurements"]["update_site"] == {"place": f"train.py:{step_line}",
                                                     "code": "ema.step(model.parameters())", "updates": 196}
    (trial,) = report["trials"]
    assert trial["fix"] == "foreach-ema" and trial["failed"] is None and trial["rounds"] == 1
    assert trial["applied"] == ["EMAModel(foreach=True)"]  # the fix's run built it so; the base run did not
    assert trial["predicted"] == pytest.approx(1 / (1 - finding["cost"]), rel=1e-3)
    assert trial["measured"] == pytest.approx(trial["base_ms"][0] / trial["fix_ms"][0])


def test_the_foreach_ema_trial_builds_diffusers_emamodel_with_foreach():
    """`--try`'s foreach-ema: an EMAModel built with foreach unset or False (by name or in its place) is built with
    foreach=True and says so; one already foreach is left as it is; the class is as it was afterwards."""
    pytest.importorskip("diffusers")
    from diffusers.training_utils import EMAModel

    from fastddpm.doctor.trials import _Fix

    params = list(torch.nn.Linear(2, 2).parameters())
    with _Fix("foreach-ema") as fix:
        unset, named = EMAModel(params), EMAModel(params, decay=0.99, foreach=False)
        positional, already = EMAModel(params, 0.99, 0.0, 0, False, 1.0, 2 / 3, False), EMAModel(params, foreach=True)
    assert unset.foreach and named.foreach and positional.foreach and already.foreach
    assert fix.applied == ["EMAModel(foreach=True)"] * 3
    assert not EMAModel(params).foreach  # the hook is gone afterwards


def test_the_foreach_ema_it_prescribes_is_not_flagged(tmp_path):
    """The fix applied: one _foreach_lerp_ call, whose per-tensor work runs inside it, is no loop of updates."""
    report, _ = _run(tmp_path, FOREACH)
    assert report["measurements"]["trace"]["param_update_loop"] is None
    assert "update_site" not in report["measurements"]  # one call a step is no loop's place either
    assert _finding(report, "per-tensor-ema") is None


PER_SAMPLE_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.SiLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0)
    loader = DataLoader(TensorDataset(torch.randn(4096, 2)), batch_size=32, shuffle=True)
    for epoch in range(1000):
        for (x0,) in loader:
            t = torch.randint(0, 1000, (len(x0),))
            noise = torch.randn_like(x0)
            a = abar[t][:, None]
            pred = model(torch.cat([a.sqrt() * x0 + (1 - a).sqrt() * noise, t[:, None] / 1000], 1))
            LOSS
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
""")


def test_a_per_sample_loss_loop_is_found_at_its_line(tmp_path):
    """The loss summed sample by sample (pred[i], noise[i] over the batch of 32) in a script the doctor runs: rule
    22's finding names the line that indexes them, as the script has it, and its fix points there."""
    loss = "loss = sum(F.mse_loss(pred[i], noise[i]) for i in range(len(pred))) / len(pred)"
    report, text = _run(tmp_path, "", script=PER_SAMPLE_SCRIPT.replace("LOSS", loss))
    line = 1 + [s.strip() for s in PER_SAMPLE_SCRIPT.splitlines()].index("LOSS")
    assert report["measurements"]["item_sites"][0] == {"place": f"train.py:{line}", "code": loss, "items": 64,
                                                       "length": 32}
    assert "update_site" not in report["measurements"]  # the loss's per-sample ops are no EMA
    finding = _finding(report, "item-loop")
    assert finding is not None, text
    assert f"indexed one by one each step at train.py:{line} (`{loss}`)" in finding["evidence"][0]
    assert finding["fixes"][0]["code"].startswith(f"replace the loop at train.py:{line} with one op over the whole")


def test_a_loop_iterating_the_batch_is_found_at_its_line(tmp_path):
    """The same loss written `for p, n in zip(pred, noise):`: torch splits each tensor inside Tensor.__iter__, so
    the line that iterates them is the script's `for` line, and rule 22's finding names it as it names an x[i]."""
    loop = "for p, n in zip(pred, noise):"
    loss = f"loss = 0\n        {loop}\n            loss = loss + F.mse_loss(p, n) / len(pred)"
    script = PER_SAMPLE_SCRIPT.replace("LOSS", loss)
    report, text = _run(tmp_path, "", script=script)
    line = 1 + [s.strip() for s in script.splitlines()].index(loop)
    assert report["measurements"]["item_sites"][0] == {"place": f"train.py:{line}", "code": loop, "items": 64,
                                                       "length": 32}
    finding = _finding(report, "item-loop")
    assert finding is not None, text
    assert f"indexed one by one each step at train.py:{line} (`{loop}`)" in finding["evidence"][0]
    assert finding["fixes"][0]["code"].startswith(f"replace the loop at train.py:{line} with one op over the whole")


def test_loop_sites_count_the_users_own_iteration_of_a_tensor_only():
    """A tensor iterated (or unbound) by the user's own line is counted there, one item for each of its first
    dimension's; chunks, parameters and the standard library's iteration of a tensor are not the user's loop."""
    import statistics

    from fastddpm.doctor.watchers import LoopSites

    batch, model = torch.randn(8, 3), torch.nn.Linear(3, 2)
    with LoopSites() as sites:
        rows_line = sys._getframe().f_lineno + 1
        rows = [row.sum() for row in batch]
        halves = batch.chunk(2)
        weights = [p for p in model.parameters()]
        statistics.fmean(batch.sum(1))  # iterated inside statistics, not by this line
        columns = batch.unbind(1)  # along the second dimension: no item of the batch
    assert len(rows) == 8 and len(halves) == 2 and len(weights) == 2 and len(columns) == 3
    here = f"test_doctor_styles.py:{rows_line} in test_loop_sites_count_the_users_own_iteration_of_a_tensor_only"
    assert sites.item_sites() == [{"place": here, "code": "rows = [row.sum() for row in batch]", "items": 8,
                                   "length": 8}]


def test_watch_finds_the_lines_of_a_per_sample_loss_and_an_ema_loop():
    """fastddpm.doctor.watch() in the loop itself: one warm-up step counts the loss's x[i] at its line and the EMA's
    in-place updates after the optimizer step at theirs (not the forward's, which come before it)."""
    import fastddpm.doctor

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(10)])
    params = list(model.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1e-3)
    data = [torch.randn(16, 8) for _ in range(4)]
    with fastddpm.doctor.watch(data * 10, warmup_steps=2, steps=3, profile_steps=1, loader_probe_s=0, device="cpu",
                               print_report=False, time_budget_s=None) as dr:
        for x in dr.batches():
            x.mul_(0.5)  # the batch scaled in place, before the forward: once a step, no loop
            out = model(x)
            loss_line = sys._getframe().f_lineno + 1
            loss = sum(out[i].square().mean() for i in range(len(out))) / len(out)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema_line = sys._getframe().f_lineno + 2
            with torch.no_grad():
                for e, p in zip(ema, params): e.lerp_(p, 0.01)  # noqa: E701 - one line: its place
            dr.step()
    m = dr.report.measurements
    here = "test_doctor_styles.py"
    assert m["item_sites"] == [{"place": f"{here}:{loss_line}", "items": 16, "length": 16,
                                "code": "loss = sum(out[i].square().mean() for i in range(len(out))) / len(out)"}]
    assert m["update_site"] == {"place": f"{here}:{ema_line} in test_watch_finds_the_lines_of_a_per_sample_loss_"
                                         "and_an_ema_loop", "updates": 20,
                                "code": "for e, p in zip(ema, params): e.lerp_(p, 0.01)"}


def test_rule_param_loop_on_hand_built_measurements():
    """Rule 23 fires on a loop over the parameters (half their elements or more) taking over 5% of the step, costs
    half of it, takes its ops out of rule 18's elementwise share, and on a GPU counts only up to the idle share,
    which the host-bound finding then leaves to it."""
    from test_doctor_rules import check, cpu_trace, gpu_trace, record

    from fastddpm.doctor import rules
    from fastddpm.doctor.measurements import OptimizerInfo

    opt = OptimizerInfo(name="AdamW", param_tensors=100, foreach=None, fused=True, param_count=1_000_000)
    loop = {"updates": 200, "elements": 2_000_000, "span_us": 2000.0, "ops_us": 1500.0, "step_us": 10_000.0,
            "per_tensor_ops": ["aten::mul_", "aten::add_"]}
    f, _ = check(rules.param_loop, record(trace=cpu_trace(param_update_loop=loop), optimizer=opt))
    assert f.id == "per-tensor-ema" and f.cost == 0.5 * 0.2 and "over the 100 parameter tensors" in f.cause
    # a loop over a few activations, not the parameters; a loop too short to cost 5%
    few = {**loop, "elements": 400_000}
    assert check(rules.param_loop, record(trace=cpu_trace(param_update_loop=few), optimizer=opt))[0] is None
    short = {**loop, "span_us": 400.0, "ops_us": 300.0}
    assert check(rules.param_loop, record(trace=cpu_trace(param_update_loop=short), optimizer=opt))[0] is None
    # rule 18: elementwise 30% + norm 5%, of which the EMA's ops are 15%: 20% is under its 25%
    split = {"elementwise": 0.3, "norm": 0.05}
    assert check(rules.eager_elementwise, record(trace=cpu_trace(split=split)))[0] is not None
    assert check(rules.eager_elementwise,
                 record(trace=cpu_trace(split=split, param_update_loop=loop), optimizer=opt))[0] is None
    # a GPU waiting for the host: host-bound leaves the loop's cost to it; idle 12%: the loop's 20% counts as 12%
    waiting = dict(idle_share=0.5, host_wait_share=0.45, kernel_wait_share=0.05,
                   host_wait_by_cause={"data": 0.0, "sync": 0.0, "host": 0.4})
    m = record(device="cuda:0", trace=gpu_trace(**waiting, param_update_loop=loop), optimizer=opt)
    assert check(rules.param_loop, m)[0].cost == 0.5 * 0.2
    host, _ = check(rules.host_bound, m)
    assert host.cost == 0.4 - 0.1 and "costed under PER-TENSOR EMA" in host.evidence[-1]
    idle = record(device="cuda:0", trace=gpu_trace(idle_share=0.12, param_update_loop=loop), optimizer=opt)
    assert check(rules.param_loop, idle)[0].cost == 0.5 * 0.12


ACCUMULATING_SCRIPT = textwrap.dedent("""
    import time
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):  # file-read latency, not CPU work
        def __len__(self):
            return 4096
        def __getitem__(self, i):
            time.sleep(0.002)
            return torch.randn(64)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accum = 4  # micro-batches per optimizer step
    for epoch in range(100):
        for i, x in enumerate(DataLoader(Slow(), batch_size=8)):
            loss = model(x).square().mean() / accum
            loss.backward()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
""")


def test_an_accumulating_loop_needs_a_loader_for_every_micro_batch(tmp_path):
    """Gradients accumulated over 4 batches per optimizer step: the loader alone is compared with the 4 batches
    each step takes, not one, and more workers are counted to give back at most what 4 batches at their rate
    allow (one batch's time per step promised several times more than the workers can deliver)."""
    from fastddpm.doctor import DoctorConfig
    from fastddpm.doctor.runners import run_script
    from fastddpm.doctor.system import usable_cores

    script = tmp_path / "train.py"
    script.write_text(ACCUMULATING_SCRIPT)
    cfg = DoctorConfig(warmup_steps=2, steps=4, profile_steps=1, loader_probe_s=0.3, out_dir=tmp_path / "rep",
                       time_budget_s=None)
    report = run_script(script, [], cfg, log=lambda *a: None)
    assert [s["batches"] for s in report.measurements["steps"]] == [4] * 4
    assert report.measurements["batch_size"] == 8  # the loader built in the `for` is the training one
    probe = report.measurements["loader_probe"]
    assert probe["batches_per_step"] == 4
    assert probe["ratio"] == pytest.approx(probe["batches_per_s"] / (4 * probe["train_steps_per_s"]))
    finding = report.finding("data-bound")
    assert finding is not None and report.bottleneck == "data-bound", report.text()
    assert f"optimizer steps/s, each accumulating gradients over 4 batches; {probe['ratio']:.2f}x, want >= 1.5x)" \
        in finding.evidence[1]
    workers = next(f for f in finding.fixes if f.trial)
    n = min(8, usable_cores())
    assert workers.trial == f"loader-workers:{n}"
    step_ms = report.measurements["step_stats"]["median_ms"]
    assert 1.0 <= workers.gain <= step_ms / (4 * 1000 / (n * probe["batches_per_s"])) + 1e-9


def test_a_small_micro_batch_is_fixed_by_accumulating_fewer_larger_ones(tmp_path):
    """Rule 20 on a loop accumulating 4 micro-batches of 4 per optimizer step: the fix keeps the 16 images per
    step (and the learning rate) with micro-batches of 8 accumulated over 2, and its estimate counts the overhead
    paid per micro-batch, not the optimizer's, which runs once per step whatever the micro-batch."""
    import fastddpm.doctor

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    data = [torch.randn(4, 16) for _ in range(8)]
    kw = dict(warmup_steps=1, steps=4, profile_steps=2, loader_probe_s=0, device="cpu", print_report=False,
              out=tmp_path / "rep", time_budget_s=None)
    with fastddpm.doctor.watch(data * 100, **kw) as dr:
        for i, x in enumerate(dr.batches()):
            (model(x).square().mean() / 4).backward()
            if (i + 1) % 4 == 0:
                opt.step()
                opt.zero_grad()
                dr.step()
    report = dr.report
    m = report.measurements
    assert [s["batches"] for s in m["steps"]] == [4] * 4 and m["batch_size"] == 4
    finding = report.finding("small-batch")
    assert finding is not None, report.text()
    assert finding.title == "SMALL MICRO-BATCH: 4 images per forward, 4 accumulated per optimizer step"
    assert finding.fixes[0].code.startswith("raise the DataLoader's batch_size and lower the accumulation steps by "
                                            "the same factor (batch_size=8, accumulated over 2): the same 16 images "
                                            "per optimizer step, so the same learning rate")
    measured = fastddpm.doctor.measurements.Measurements.from_dict(m)
    per_micro = measured.unprofiled_share("python") + measured.unprofiled_share("framework")
    assert finding.cost == pytest.approx(0.5 * per_micro)


PER_EPOCH_LOADER_SCRIPT = textwrap.dedent("""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 32))
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for epoch in range(1000):
        for (x,) in DataLoader(data, batch_size=16, num_workers=2):  # new workers every epoch
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
""")


def test_a_loader_built_every_epoch_starts_an_epoch_and_is_told_to_be_built_once(tmp_path):
    """`for x in DataLoader(...)` inside the epoch loop makes a new loader each epoch: its iterators were not
    the training loader's, so no epoch start was seen and rule 2 never fired; and its fix, persistent_workers=True,
    changes nothing on a loader that lives one epoch."""
    from fastddpm.doctor import DoctorConfig
    from fastddpm.doctor.runners import run_script

    script = tmp_path / "train.py"
    script.write_text(PER_EPOCH_LOADER_SCRIPT)
    cfg = DoctorConfig(warmup_steps=2, steps=12, profile_steps=1, loader_probe_s=0, out_dir=tmp_path / "rep",
                       time_budget_s=None)
    report = run_script(script, [], cfg, log=lambda *a: None)
    steps = report.measurements["steps"]
    assert [s["epoch_start"] for s in steps] == [s["index"] % 4 == 0 for s in steps]  # 64 images, batch 16
    assert report.measurements["loader_per_epoch"] is True
    finding = report.finding("epoch-spikes")
    assert finding is not None, report.text()
    assert "builds a new DataLoader every epoch" in finding.cause
    assert finding.fixes[0].code.startswith("build the DataLoader once, before the epoch loop, with "
                                            "persistent_workers=True")
