"""The doctor on loops written as other people write them: a linear-attention U-Net block (softmax over the
feature axis, no L x L matrix) is not materialised attention, while the same block with softmax(QK^T) is;
RMSNorm written with F.normalize counts as a norm; the loop's own .item() is counted, not a per-tensor
optimizer's internal ones; a CPU report draws no GPU lanes and a foreign script's report no fastddpm settings;
doctor options after the script name, and scripts that do not start, end in one clear line."""

from __future__ import annotations

import json
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastddpm.doctor
from fastddpm.cli import main


class RMSNorm(nn.Module):
    """As lucidrains' denoising-diffusion-pytorch writes it: F.normalize over channels, then a gain."""

    def __init__(self, dim: int):
        super().__init__()
        self.g = nn.Parameter(torch.ones(1, dim, 1, 1))
        self.scale = dim ** 0.5

    def forward(self, x):
        return F.normalize(x, dim=1) * self.g * self.scale


class Attention2d(nn.Module):
    """Multi-head attention over the H x W tokens. linear=True: softmax over the head's features (q) and over
    the tokens (k), K V^T first (a d x d context, never L x L), as in lucidrains' LinearAttention."""

    def __init__(self, dim: int, *, linear: bool, heads: int = 4, dim_head: int = 16):
        super().__init__()
        self.linear, self.heads, self.scale = linear, heads, dim_head ** -0.5
        hidden = heads * dim_head
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, 3 * hidden, 1, bias=False)
        self.to_out = nn.Conv2d(hidden, dim, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = (t.reshape(b, self.heads, -1, h * w) for t in self.to_qkv(self.norm(x)).chunk(3, dim=1))
        if self.linear:
            q, k = q.softmax(dim=-2) * self.scale, k.softmax(dim=-1)
            context = torch.einsum("bhdn,bhen->bhde", k, v)
            out = torch.einsum("bhde,bhdn->bhen", context, q)
        else:
            attn = torch.einsum("bhdi,bhdj->bhij", q * self.scale, k).softmax(dim=-1)  # (b, heads, L, L)
            out = torch.einsum("bhij,bhdj->bhdi", attn, v)
        return x + self.to_out(out.reshape(b, -1, h, w))


def _diagnose(tmp_path, model: nn.Module, *, item: bool = False, **window) -> fastddpm.doctor.Report:
    torch.manual_seed(0)
    data = [torch.randn(8, 32, 16, 16) for _ in range(4)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    kw = dict(warmup_steps=1, steps=4, profile_steps=2, loader_probe_s=0, device="cpu", print_report=False,
              out=tmp_path / "rep", time_budget_s=None)
    with fastddpm.doctor.watch(data, **{**kw, **window}) as dr:
        for x in dr.batches():
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if item:
                loss.item()
            dr.step()
    return dr.report


def _block(linear: bool) -> nn.Module:
    return nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), Attention2d(32, linear=linear))


def test_linear_attention_is_not_materialised_attention(tmp_path):
    report = _diagnose(tmp_path, _block(linear=True), warmup_steps=2)
    trace = report.measurements["trace"]
    assert report.finding("attention-weights") is None, report.text()
    assert "attention_sites" not in report.measurements  # its softmaxes are over (d, L) and (L, d), not (L, L)
    assert trace["breakdown"]["attention"] == 0.0 and not trace["attention_share_by_impl"]
    assert trace["breakdown"]["matmul"] > 0.0  # its einsums are plain matmuls
    assert trace["breakdown"]["norm"] > 0.0  # RMSNorm's F.normalize reduction is a norm


def test_written_out_attention_is_still_materialised(tmp_path):
    trace = _diagnose(tmp_path, _block(linear=False)).measurements["trace"]
    impl = trace["attention_share_by_impl"]
    assert set(impl) == {"softmax(QK^T)V (materialised)"} and impl["softmax(QK^T)V (materialised)"] > 0.0


def test_materialised_attention_is_named_by_its_module_and_the_place_to_change(tmp_path):
    """The finding names the module that built the weights (its name in the model, its class, where the class
    and its forward are written) and the fix points at that forward."""
    import inspect

    report = _diagnose(tmp_path, _block(linear=False), warmup_steps=2)
    cls_line = inspect.getsourcelines(Attention2d)[1]
    forward_line = inspect.getsourcelines(Attention2d.forward)[1]
    here = "tests/test_doctor_foreign.py"
    assert report.measurements["attention_sites"] == [
        {"module": "Sequential.1", "cls": "Attention2d", "defined_at": f"{here}:{cls_line}",
         "forward_at": f"{here}:{forward_line}", "tokens": 16 * 16}]
    finding = report.finding("attention-weights")
    assert finding is not None, report.text()
    assert f"built by Sequential.1 (class Attention2d, defined at {here}:{cls_line}): 256 x 256 weights" \
        in finding.evidence
    assert finding.fixes[-1].code.startswith(f"in Attention2d.forward ({here}:{forward_line}): replace softmax(")
    assert f"Attention2d.forward ({here}:{forward_line})" in report.text()
    # the hooks are gone with the counted step
    from torch.nn.modules import module as module_mod

    assert not module_mod._global_forward_pre_hooks and not module_mod._global_forward_hooks


def test_item_counts_the_loops_own_calls_not_the_optimizers(tmp_path):
    """A per-tensor AdamW reads each tensor's step counter with .item() inside its step (dozens of calls); the
    loop's own loss.item() is the one a user wrote."""
    report = _diagnose(tmp_path, _block(linear=True), item=True)
    assert report.measurements["trace"]["scalar_reads_per_step"] == pytest.approx(1.0)
    assert report.measurements["trace"]["optimizer_kind"] == "per-tensor"


def test_a_cpu_report_draws_no_gpu_lanes_and_a_users_report_no_fastddpm_settings(tmp_path):
    _diagnose(tmp_path, _block(linear=False))
    page = (tmp_path / "rep" / "report.html").read_text()
    assert 'id="timeline"' in page and "GPU busy" not in page and "GPU idle" not in page
    assert "fastddpm:</b>" not in page and "--precision" not in page
    assert "fastddpm's U-Net" not in page and "fastddpm's AdamW" not in page


def test_doctor_options_after_the_script_name_are_refused_with_where_they_go(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    code = main(["doctor", "run", str(script), "--epochs", "1", "--report-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "--report-dir comes after the script name" in err
    assert f"fastddpm doctor run --report-dir ... {script} ARGS" in err


@pytest.mark.parametrize("source, where", [
    ("import torch\nx = (1,\n", "SyntaxError at {script}:2"),
    ("import torch\nimport no_such_module_here\n", "ModuleNotFoundError: No module named 'no_such_module_here' "
                                                    "({script}:2)"),
])
def test_a_script_that_does_not_start_gets_one_line(tmp_path, capsys, source, where):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    code = main(["doctor", "run", "--report-dir", str(tmp_path / "r"), str(script)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{script} does not start: " + where.format(script=script) in err
    assert "Traceback" not in err


def test_a_script_that_raises_before_its_first_step_gets_one_line(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = torch.zeros(3)\nraise ValueError('the data folder is empty')\n")
    code = main(["doctor", "run", "--report-dir", str(tmp_path / "r"), str(script)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{script} raised ValueError: the data folder is empty ({script}:3) after 0 optimizer steps" in err
    assert "Traceback" not in err


def test_a_script_that_raises_after_measured_steps_is_diagnosed_on_them(tmp_path):
    """An error after the doctor measured steps (an evaluation that crashes, a bad batch late in the data): the
    report is made from the steps measured, and says how the loop ended."""
    from fastddpm.doctor import DoctorConfig
    from fastddpm.doctor.runners import run_script

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Linear(32, 32)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(100):
            if step == 6:
                raise RuntimeError('evaluation crashed')
            model(torch.randn(16, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    """))
    cfg = DoctorConfig(warmup_steps=2, steps=10, profile_steps=0, loader_probe_s=0, out_dir=tmp_path / "rep",
                       time_budget_s=None)
    report = run_script(script, [], cfg, log=lambda *a: None)
    notes = report.measurements["notes"]
    ended = [n for n in notes if "the loop ended after" in n]
    assert ended and f"the script raised RuntimeError: evaluation crashed ({script}:7)" in ended[0], notes
    assert report.bottleneck and "the script raised RuntimeError" in report.text()


LIGHTNING_SCRIPT = textwrap.dedent("""
    import lightning as L
    import torch


    class Denoiser(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.SiLU(),
                                           torch.nn.Conv2d(32, 3, 3, padding=1))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            noise = torch.randn_like(x)
            return torch.nn.functional.mse_loss(self.net(x + noise), noise)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)


    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 3, 32, 32)), batch_size=16)
    trainer = L.Trainer(max_steps=40, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Denoiser(), loader)
""")


def test_doctor_run_on_a_real_lightning_script(tmp_path, monkeypatch):
    """Lightning itself (a test extra) drives the loop: its optimizer steps are the step boundaries, the Trainer is
    found at the user's line, and a precision fix is worded as that Trainer's argument."""
    from conftest import restore_env_after
    from fastddpm.doctor import DoctorConfig
    from fastddpm.doctor.runners import run_script

    restore_env_after(monkeypatch, "PYTORCH_NVML_BASED_CUDA_CHECK")  # importing Lightning sets it
    pytest.importorskip("lightning", reason="Lightning is a test extra: pip install -e '.[test]'")
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    place = f"train.py:{1 + next(i for i, s in enumerate(LIGHTNING_SCRIPT.splitlines()) if 'L.Trainer(' in s)}"
    cfg = DoctorConfig(warmup_steps=3, steps=8, profile_steps=1, loader_probe_s=0.2, out_dir=tmp_path / "rep",
                       time_budget_s=None)
    report = run_script(script, [], cfg, log=lambda *a: None)
    assert report.bottleneck, report.text()
    built = [b for b in report.script["built"] if b["kind"] == "Trainer"]
    assert len(built) == 1 and built[0]["framework"] == "lightning" and built[0]["place"] == place
    assert built[0]["effective"]["precision"] == "32-true"
    autocast = [fix for f in report.findings for fix in f.fixes if (fix.trial or "").startswith("autocast-")]
    for fix in autocast:  # only where this CPU (or GPU) would gain from autocast
        assert fix.code.startswith("Trainer(precision=") and place in fix.code, fix.code


# ---------------------------------------------------------------------------------------------------------------
# Fixes in the script's own terms, and fixes tried (--try)

LOADER_SCRIPT = textwrap.dedent("""
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
    for epoch in range(100):
        for x in DataLoader(Slow(), batch_size=16):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
""")


def test_try_measures_the_loader_fix_on_the_unchanged_script(tmp_path):
    """A loader that sleeps per item: the fix is the script's own DataLoader call, at its line, with the workers
    the finding prescribes (up to eight, no more than the cores); --try runs it against the unchanged script and
    measures the gain (n workers overlapping 2 ms sleeps: close to n times; more than 2x from four on)."""
    from fastddpm.doctor import DoctorConfig
    from fastddpm.doctor.runners import run_script
    from fastddpm.doctor.system import usable_cores

    script = tmp_path / "train.py"
    script.write_text(LOADER_SCRIPT)
    line = 1 + next(i for i, s in enumerate(LOADER_SCRIPT.splitlines()) if "DataLoader(Slow()" in s)
    cfg = DoctorConfig(warmup_steps=2, steps=6, profile_steps=1, loader_probe_s=0.3, out_dir=tmp_path / "rep",
                       time_budget_s=None)
    report = run_script(script, [], cfg, try_fixes=1, try_rounds=2, log=lambda *a: None)
    assert report.bottleneck == "data-bound"
    fix = next(f for f in report.finding("data-bound").fixes if f.trial)
    n = min(8, usable_cores())
    assert fix.trial == f"loader-workers:{n}" and fix.code == f"DataLoader(..., num_workers={n}) at train.py:{line} " \
                                                              "(now num_workers=0)"
    (trial,) = report.trials
    assert trial["fix"] == f"loader-workers:{n}" and trial["rounds"] == 2 and trial["failed"] is None
    assert trial["applied"] == [f"DataLoader(num_workers={n}, persistent_workers=True)"]
    assert trial["measured"] > min(2.0, 0.65 * n) and trial["predicted"] > 1.0
    saved = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert saved["trials"] == report.trials
    assert f"tried: loader-workers:{n}" in (tmp_path / "rep" / "report.txt").read_text()


def test_the_workers_trial_raises_a_loaders_own_smaller_num_workers():
    """The fix prescribes N workers; a loader built with fewer (positionally or by name) is raised to N in the
    trial, so the advice is measured; one with N or more is left alone, and the trial says it changed nothing."""
    from torch.utils.data import DataLoader

    from fastddpm.doctor.trials import _Fix

    data = torch.randn(32, 4)
    with _Fix("loader-workers:2") as fix:  # 2: no more than the cores of a small CI machine
        named, positional = DataLoader(data, batch_size=4, num_workers=1), DataLoader(data, 4, False, None, None, 1)
        enough = DataLoader(data, batch_size=4, num_workers=2)
    assert (named.num_workers, positional.num_workers, enough.num_workers) == (2, 2, 2)
    assert named.persistent_workers and positional.persistent_workers and not enough.persistent_workers
    assert fix.applied == ["DataLoader(num_workers=2, persistent_workers=True) (was num_workers=1)"] * 2
    assert DataLoader(data, num_workers=1).num_workers == 1  # the hook is gone afterwards


MODEL_SCRIPT = textwrap.dedent("""
    import torch
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=FOREACH)
    x = torch.randn(4, 4, 8, 8)
    for step in range(1000):
        out = model(x)
        if step == 2:  # what the step computed in, and the layout it saw, one line per process
            with open(LOG, "a") as f:
                f.write(f"{out.dtype} {model[0].weight.is_contiguous(memory_format=torch.channels_last)} "
                        f"{opt.defaults.get('fused')} {model._compiled_call_impl is not None}\\n")
        loss = out.float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


@pytest.mark.parametrize("fix, applied, seen", [
    ("autocast-bf16", "torch.autocast(dtype=torch.bfloat16) around the model's forward: Sequential.forward",
     "torch.bfloat16 False None False"),
    ("fused-optimizer", "AdamW(fused=True)", "torch.float32 False True False"),
    ("channels-last", "channels_last weights and inputs: Sequential.forward", "torch.float32 True None False"),
    ("compile", "compiled Sequential", "torch.float32 False None True"),
])
def test_each_outside_fix_applies_itself_and_says_so(tmp_path, fix, applied, seen):
    """The hooks of a trial change what they say they change, in the fix's runs only: the script logs the dtype
    its model computed in, its weights' layout and its optimizer's fused flag, and the trial reports each change;
    a fix that finds nothing to change says so and is not measured."""
    from fastddpm.doctor.trials import WHAT, Trial, run_trials

    script, log = tmp_path / "train.py", tmp_path / "seen.txt"
    script.write_text(MODEL_SCRIPT.replace("FOREACH", "False").replace("LOG", repr(str(log))))
    (trial,) = run_trials(script, [], [Trial(fix, WHAT[fix], None, None)], rounds=1, warmup=4, steps=3,
                          log=lambda *a: None)
    assert trial.failed is None and applied in trial.applied[0]
    assert trial.measured is not None and trial.measured > 0
    base_line, fix_line = log.read_text().splitlines()  # the base run, then the fix's
    assert (base_line, fix_line) == ("torch.float32 False None False", seen)


def test_a_fix_that_finds_nothing_to_change_claims_nothing(tmp_path):
    """Where nothing matches, nothing is claimed: the fused-optimizer fix leaves a foreach optimizer alone, says
    it changed nothing, and is not measured."""
    from fastddpm.doctor.trials import Trial, run_trials

    script = tmp_path / "train.py"
    script.write_text(MODEL_SCRIPT.replace("FOREACH", "True").replace("LOG", repr(str(tmp_path / "seen.txt"))))
    (none,) = run_trials(script, [], [Trial("fused-optimizer", "", None, None)], rounds=1, warmup=4, steps=3,
                         log=lambda *a: None)
    assert none.applied == [] and none.measured is None and none.failed is None
    assert len((tmp_path / "seen.txt").read_text().splitlines()) == 2  # both runs ran the script


def test_the_fp32_fix_turns_the_scripts_own_autocast_off_inside_the_model(tmp_path):
    """A loop under bf16 autocast on a CPU that emulates bf16: the trial runs the model's forward with autocast off,
    whatever the script's own `with torch.autocast(...)` says."""
    from fastddpm.doctor.trials import WHAT, Trial, run_trials

    script, log = tmp_path / "train.py", tmp_path / "seen.txt"
    under_autocast = MODEL_SCRIPT.replace("    out = model(x)\n", "    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
                                                               "        out = model(x)\n")
    assert under_autocast != MODEL_SCRIPT
    script.write_text(under_autocast.replace("FOREACH", "False").replace("LOG", repr(str(log))))
    (trial,) = run_trials(script, [], [Trial("autocast-fp32", WHAT["autocast-fp32"], None, None)], rounds=1,
                          warmup=4, steps=3, log=lambda *a: None)
    assert trial.failed is None and "autocast turned off" in trial.applied[0] and trial.measured > 0
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["torch.bfloat16", "torch.float32"]


ACCELERATE_SCRIPT = textwrap.dedent("""
    import argparse
    import torch
    from accelerate import Accelerator
    p = argparse.ArgumentParser()
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    args = p.parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=True)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Conv2d(8, 4, 1))
    computed_in = []  # the first convolution's output dtype (accelerate hands the model's output back in fp32)
    model[0].register_forward_hook(lambda module, args, out: computed_in.append(out.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    x = torch.randn(4, 4, 8, 8)
    for step in range(1000):
        out = model(x)
        assert computed_in[-1] == (torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32)
        opt.zero_grad()
        accelerator.backward(out.float().square().mean())
        opt.step()
""")


def test_an_accelerate_scripts_own_flag_is_the_precision_fix_and_what_try_runs(tmp_path, monkeypatch):
    """For an accelerate script with a --mixed_precision flag, autocast is that flag (not a raw torch.autocast the
    user would have to write into accelerate's loop), and --try runs the script with it."""
    pytest.importorskip("accelerate", reason="accelerate is a test extra: pip install 'fastddpm[test]'")
    from accelerate.state import AcceleratorState

    from fastddpm.doctor.findings import Finding, Fix
    from fastddpm.doctor.report import Report
    from fastddpm.doctor.runners import in_script_terms
    from fastddpm.doctor.script_context import ScriptContext
    from fastddpm.doctor.trials import plan, run_trials
    import runpy
    import sys

    script = tmp_path / "train.py"
    script.write_text(ACCELERATE_SCRIPT.replace("range(1000)", "range(2)"))
    monkeypatch.setattr(sys, "argv", [str(script)])
    ctx = ScriptContext(script)
    with ctx:
        runpy.run_path(str(script), run_name="__main__")
    AcceleratorState._reset_state(True)  # one Accelerator state per process: the next test builds its own
    raw = "with torch.autocast('cpu', dtype=torch.bfloat16): loss = ..."
    finding = Finding("fp32", (16,), "FP32 MATMULS", 0.3, ["..."], "...",
                      [Fix("--precision bf16", raw, trial="autocast-bf16")], group="compute")
    report = Report(verdict={"id": "fp32", "healthy": False}, findings=[finding], measurements={}, unavailable={},
                    environment={})
    in_script_terms(report, ctx)
    fix = finding.fixes[0]
    assert fix.code == "pass --mixed_precision bf16 (train.py's own flag; this run had 'no')"
    assert fix.args == ("--mixed_precision", "bf16")
    assert report.script["frameworks"][0].startswith("accelerate ")

    script.write_text(ACCELERATE_SCRIPT)
    (trial,) = run_trials(script, [], plan([finding], 1), rounds=1, warmup=2, steps=3, log=lambda *a: None)
    assert trial.fix == "flag --mixed_precision bf16" and trial.failed is None  # the script's assert saw bf16
    assert trial.applied == ["ran with --mixed_precision bf16"] and trial.measured is not None


# ---------------------------------------------------------------------------------------------------------------
# The pieces, on hand-made inputs


def _op(name, dims, concrete=None):
    return {"name": name, "cat": "cpu_op", "args": {"Input Dims": dims, **({"Concrete Inputs": concrete}
                                                                            if concrete else {})}}


@pytest.mark.parametrize("tokens, head", [(256, 16), (16, 32), (64, 64)])
def test_attention_is_told_from_linear_attention_by_the_weights_square(tokens, head):
    """Materialised attention has a softmax over an (L, L) square and batched matmuls that make or use one of
    that size, whether L is longer than the head's d or not; linear attention's softmax is over a (d, L) tensor
    and its only square is K V^T's d x d."""
    from fastddpm.doctor.trace_optree import weights_bmm, weights_side

    bh, L, d = 8, tokens, head
    assert weights_side(_op("aten::_softmax", [[bh, L, L], [], []])) == L
    sides = {L}
    assert weights_bmm(_op("aten::bmm", [[bh, L, d], [bh, d, L]]), sides)  # Q K^T
    assert weights_bmm(_op("aten::bmm", [[bh, L, L], [bh, L, d]]), sides)  # the weights times V
    assert weights_bmm(_op("aten::bmm", [[bh, d, L], [bh, L, L]]), sides)  # the same, operands swapped
    if L != d:  # linear attention: no (L, L) softmax, so no side to match; its K V^T and its output
        assert weights_side(_op("aten::_softmax", [[bh, d, L], [], []])) is None
        assert not weights_bmm(_op("aten::bmm", [[bh, d, L], [bh, L, d]]), {17})
        assert not weights_bmm(_op("aten::bmm", [[bh, d, d], [bh, d, L]]), {17})
    assert weights_side(_op("aten::_softmax", [])) == 0 and weights_bmm(_op("aten::bmm", []), {0})  # no shapes


def test_a_norm_that_keeps_its_dim_is_a_norm_and_gradient_clippings_is_not():
    from fastddpm.doctor.trace_optree import _keepdim

    assert _keepdim(_op("aten::linalg_vector_norm", [[2, 8, 4, 4]], ["", "2.", "[1]", "True", ""]))  # F.normalize
    assert not _keepdim(_op("aten::linalg_vector_norm", [[2, 8, 4, 4]], ["", "2", "", "False", ""]))  # clipping


def test_a_trial_compares_per_image_when_a_setting_changes_the_batch(monkeypatch):
    """Base: 100 ms for 16 images a step; the fix: 50 ms for 8. Per image they are equal: 1.00x exactly."""
    from fastddpm.doctor import trials

    def fake(cfg, settings, warmup, steps, out, timeout_s):
        return ({"step_ms": 50.0, "per_step": 8.0, "applied": ["x"]} if settings else
                {"step_ms": 100.0, "per_step": 16.0, "applied": []})

    monkeypatch.setattr(trials, "_run_trainer", fake)
    (t,) = trials.run_trials({"preset": "tiny"}, [], [trials.Trial("--batch-size 8", "", None, None,
                                                                   settings={"train.batch_size": "8"})],
                             rounds=2, log=lambda *a: None)
    assert t.base_ms == [100.0, 100.0] and t.fix_ms == [100.0, 100.0] and t.measured == 1.0


def test_two_flag_fixes_are_two_trials_and_the_same_flag_one():
    from fastddpm.doctor.findings import Finding, Fix
    from fastddpm.doctor.trials import plan

    def finding(id_, cost, args):
        return Finding(id_, (18,), "", cost, [], "", [Fix(None, "pass ...", trial="compile", args=args)])

    same = plan([finding("eager-elementwise", 0.3, ("--torch_compile",)), finding("low-mfu", 0.1, ("--torch_compile",))],
                3)
    assert [t.fix for t in same] == ["flag --torch_compile"]
    two = plan([finding("fp32", 0.3, ("--mixed_precision", "bf16")), finding("low-mfu", 0.1, ("--torch_compile",))],
               3)
    assert [t.fix for t in two] == ["flag --mixed_precision bf16", "flag --torch_compile"]
    # a finding's second fix comes after every first fix and the channels-last candidate, while N allows
    fp32 = Finding("fp32", (16,), "", 0.3, [], "", [Fix(None, "autocast", trial="autocast-bf16"),
                                                    Fix(None, "compile too", trial="compile")])
    loader = Finding("data-bound", (1,), "", 0.2, [], "", [Fix(None, "workers", trial="loader-workers:2")])
    assert [t.fix for t in plan([fp32, loader], 4, convs=True)] == [
        "autocast-bf16", "loader-workers:2", "channels-last", "compile"]
    assert [t.fix for t in plan([fp32, loader], 2, convs=True)] == ["autocast-bf16", "loader-workers:2"]


def test_the_models_own_convolutions_are_replayed_from_a_cpu_trace(tmp_path):
    """The trace's convolutions, forward and backward, rebuilt from their recorded shapes and timed in fp32 and
    bf16; a GPU trace (whose host durations are launches) is not replayed."""
    from torch.profiler import ProfilerActivity, profile

    from fastddpm.doctor.replay import replay
    from fastddpm.doctor.trace import load_trace

    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 8, 1))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(torch.randn(4, 8, 16, 16)).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = load_trace(tmp_path / "t.json")
    got = replay(events, torch.bfloat16, "cpu")
    # the heaviest shapes until 90% of the fp32 convolution time is covered (which ones: as this machine timed them)
    assert got is not None and got.ops >= 1 and 0.9 <= got.covered <= 1.0 and got.ratio > 0
    assert "heaviest matmul/convolution shapes" in got.basis("bf16")
    assert replay(events + [{"cat": "kernel", "name": "k"}], torch.bfloat16, "cpu") is None
    # a loop under bf16 autocast: its bf16 ops are the ones replayed (what turning autocast off would give)
    assert replay(events, torch.bfloat16, "cpu", of="bf16") is None  # this trace has none
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(4, 8, 16, 16))
        out.float().sum().backward()
    prof.export_chrome_trace(str(tmp_path / "bf16.json"))
    got = replay(load_trace(tmp_path / "bf16.json"), torch.bfloat16, "cpu", of="bf16")
    assert got is not None and got.of == "bf16" and got.ratio > 0 and "of its bf16 matmul time" in got.basis("bf16")


def test_replayed_ratios_are_weighted_by_the_time_the_trace_measured_in_its_own_dtype(monkeypatch):
    """Two ops, 830 and 160 us in the trace, whose bf16 runs take 100x and 5x their fp32 time. From an fp32 trace
    the bf16 time is predicted (830 * 100 + 160 * 5 us); from a bf16 trace, the fp32 time (830 / 100 + 160 / 5 us):
    each side scales the time the trace holds, so the ratio differs with the direction."""
    from fastddpm.doctor import replay as rp

    slowdown = {(2, 2): 100.0, (4, 4): 5.0}
    monkeypatch.setattr(rp, "_rebuild", lambda e, dtype, device: (("fp32", e["key"]), ("low", e["key"])))
    monkeypatch.setattr(rp, "_time", lambda fn, device: slowdown[fn[1]] if fn[0] == "low" else 1.0)

    def trace(input_type):
        return [{"cat": "cpu_op", "name": "aten::mm", "ts": ts, "dur": dur, "tid": 1, "pid": 1, "key": (n, n),
                 "args": {"Input Dims": [[n, n], [n, n]], "Input type": [input_type, input_type]}}
                for ts, dur, n in ((0, 830, 2), (1000, 160, 4))]

    from_fp32 = rp.replay(trace("float"), torch.bfloat16, "cpu")
    from_bf16 = rp.replay(trace("c10::BFloat16"), torch.bfloat16, "cpu", of="bf16")
    assert from_fp32.ratio == pytest.approx(990 / (830 * 100 + 160 * 5))
    assert from_bf16.ratio == pytest.approx((830 / 100 + 160 / 5) / 990)
    assert from_bf16.of == "bf16" and from_bf16.ops == 2


def test_a_replayed_op_past_the_budget_is_timed_twice_and_a_quick_one_in_repeats():
    from fastddpm.doctor.replay import _time

    calls = []

    def op(seconds):
        def run():
            calls.append(seconds)
            time.sleep(seconds)
        return run

    slow = _time(op(0.06), torch.device("cpu"), budget_s=0.05)
    assert len(calls) == 3 and slow >= 0.06  # a warm-up and two timed calls
    calls.clear()
    quick = _time(op(0.001), torch.device("cpu"), budget_s=0.05)
    assert len(calls) >= 7 and 0.001 <= quick < 0.06  # a warm-up, one to size the batches, five batches


def test_a_default_run_leaves_no_trace_behind(tmp_path):
    import tempfile
    from pathlib import Path

    before = set(Path(tempfile.gettempdir()).glob("fastddpm-doctor-*"))
    _diagnose(tmp_path, _block(linear=True))
    assert not list((tmp_path / "rep").glob("*trace*"))
    assert set(Path(tempfile.gettempdir()).glob("fastddpm-doctor-*")) == before
    with pytest.raises(ValueError, match="save_trace=True keeps the trace in out_dir"):
        fastddpm.doctor.watch([], save_trace=True)


def test_a_script_rejecting_a_doctor_option_is_told_where_it_goes(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    code = main(["doctor", "run", "--report-dir", str(tmp_path / "r"), str(script), "--steps", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "exited with status 2 after 0 steps (if --steps was meant for the doctor, put it before " \
                          "the script name)" in err


def test_an_import_failing_inside_a_module_the_script_imports_names_the_scripts_line(tmp_path, capsys):
    (tmp_path / "helpers.py").write_text("import torch\nimport missing_dependency_here\n")
    script = tmp_path / "train.py"
    script.write_text("import torch\n\nimport helpers\n")
    code = main(["doctor", "run", "--report-dir", str(tmp_path / "r"), str(script)])
    err = capsys.readouterr().err
    assert code == 2 and f"No module named 'missing_dependency_here' ({script}:3)" in err
