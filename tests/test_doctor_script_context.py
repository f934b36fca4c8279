"""ScriptContext reads a user's script in its own terms: its argparse flags, the framework objects it builds and the
line of the user's code that built each, and words the doctor's fixes there. Each test writes a CPU-sized script,
runs it unchanged with runpy inside the context (as `doctor run` does) and pins the exact place and the fix."""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import textwrap
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from conftest import restore_env_after  # noqa: E402
from fastddpm.doctor.script_context import ScriptContext, _Loader  # noqa: E402

# a tiny model and a few steps, shared by the scripts below
TRAIN = """
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ds = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
"""

ACCELERATE_FLAG = """
    import argparse
    import torch
    from accelerate import Accelerator

    p = argparse.ArgumentParser()
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=True)
""" + TRAIN + """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for step, (x, y) in zip(range(args.steps), loader):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
"""

LIBRARY = """
    import torch
    from accelerate import Accelerator

    class Trainer:
        def __init__(self, model, *, amp=False, mixed_precision_type="fp16", lr=1e-3):
            self.accelerator = Accelerator(mixed_precision=mixed_precision_type if amp else "no", cpu=True)
            self.opt = torch.optim.Adam(model.parameters(), lr=lr)
            self.model, self.opt = self.accelerator.prepare(model, self.opt)

        def train(self, steps):
            for _ in range(steps):
                self.accelerator.backward(self.model(torch.randn(4, 4)).square().mean())
                self.opt.step()
                self.opt.zero_grad()
"""

RAW = """
    import torch
""" + TRAIN + """
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for x, y in torch.utils.data.DataLoader(ds, batch_size=4):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def write(path: Path, *parts: str) -> Path:
    """The script, each part dedented on its own (the shared parts are indented less than a test's own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(textwrap.dedent(part) for part in parts))
    return path


def line_of(path: Path, needle: str) -> int:
    """The 1-based line of `path` holding `needle` (exactly one)."""
    hits = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if needle in line]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


def run(script: Path, *args: str) -> tuple[ScriptContext, dict]:
    """Run `script args` unchanged inside a ScriptContext, as `doctor run` does; its globals come back too."""
    old = sys.argv[:]
    sys.argv = [str(script), *args]
    try:
        with ScriptContext(script) as ctx:
            script_globals = runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = old
    return ctx, script_globals


@pytest.fixture(autouse=True)
def fresh_modules():
    """accelerate keeps one AcceleratorState per process (a second Accelerator with another mixed_precision
    raises), and the tests' own modules (mylib, stand-ins for transformers and Lightning) are imported afresh."""
    before = set(sys.modules)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("mylib", "transformers", "pytorch_lightning"):
            del sys.modules[name]


def test_accelerate_script_flag_is_the_precision_fix(tmp_path):
    script = write(tmp_path / "train.py", ACCELERATE_FLAG)
    ctx, g = run(script, "--steps", "2")
    fix = ctx.precision_fix("bf16")
    assert (fix.kind, fix.place) == ("flag", None)
    assert fix.text == "pass --mixed_precision bf16 (train.py's own flag; this run had 'no')"
    flag = next(f for f in ctx.flags if f.dest == "mixed_precision")
    assert (flag.options, flag.value, flag.default, flag.choices, flag.switch) == (
        ("--mixed_precision",), "no", "no", ("no", "fp16", "bf16"), None)
    assert next(f for f in ctx.flags if f.dest == "steps").value == 2
    acc = next(b for b in ctx.built if b.kind == "Accelerator")
    assert acc.place == f"train.py:{line_of(script, 'Accelerator(mixed_precision')}"
    assert acc.source == "accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=True)"
    assert (acc.given, acc.effective["mixed_precision"], acc.via) == ({"mixed_precision": "no"}, "no", None)
    assert ctx.frameworks() == [f"accelerate {accelerate.__version__}: Accelerator(mixed_precision='no') at "
                                f"{acc.place}"]
    # prepare() builds a new DataLoader over the user's dataset; the loop iterates that one, and the place to
    # change is still the user's DataLoader(...) line
    loader_fix = ctx.dataloader_fix(2, loader=g["loader"].base_dataloader)
    assert loader_fix.place == f"train.py:{line_of(script, 'DataLoader(ds')}"
    assert loader_fix.text == f"DataLoader(..., num_workers=2) at {loader_fix.place} (now num_workers=0)"


def test_accelerate_argument_is_the_fix_without_a_flag(tmp_path):
    script = write(tmp_path / "train.py", ACCELERATE_FLAG.replace(
        'p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")', "").replace(
        "mixed_precision=args.mixed_precision", 'mixed_precision="no"'))
    ctx, _ = run(script)
    fix = ctx.precision_fix("bf16")
    place = f"train.py:{line_of(script, 'Accelerator(mixed_precision')}"
    assert (fix.kind, fix.place) == ("argument", place)
    assert fix.text == f"Accelerator(mixed_precision='bf16') at {place} (now mixed_precision='no')"
    assert "accelerate launch" not in fix.text  # a value passed to Accelerator(...) overrides the launcher's


def test_accelerator_given_no_precision_takes_the_launchers(tmp_path, monkeypatch):
    script = write(tmp_path / "train.py", ACCELERATE_FLAG.replace(
        'p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")', "").replace(
        "mixed_precision=args.mixed_precision, ", ""))
    ctx, _ = run(script, "--steps", "1")
    place = f"train.py:{line_of(script, 'Accelerator(cpu')}"
    fix = ctx.precision_fix("bf16")
    assert fix.place == place and fix.text.startswith(
        f"Accelerator(mixed_precision='bf16') at {place} (now mixed_precision='no', not passed); or, unchanged, "
        f"launch it as `accelerate launch --mixed_precision bf16 train.py --steps 1`")
    # what the wording relies on: accelerate's launcher sets ACCELERATE_MIXED_PRECISION, and an Accelerator
    # given no mixed_precision reads it (accelerate/state.py, AcceleratorState.__init__)
    AcceleratorState._reset_state(True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    ctx, _ = run(script, "--steps", "1")
    assert next(b for b in ctx.built if b.kind == "Accelerator").effective["mixed_precision"] == "bf16"
    assert ctx.precision_fix("bf16") is None  # on already: nothing to prescribe in the script's terms


def test_library_trainer_is_the_place_and_its_parameters_the_fix(tmp_path, monkeypatch):
    lib = tmp_path / "site"  # beside, not under, the script's folder: library code
    write(lib / "mylib" / "__init__.py", "from mylib.trainer import Trainer\n")
    write(lib / "mylib" / "trainer.py", LIBRARY)
    monkeypatch.syspath_prepend(str(lib))
    script = write(tmp_path / "proj" / "train.py", """
        import torch
        from mylib import Trainer

        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        trainer = Trainer(model, amp=False)
        trainer.train(3)
    """)
    ctx, _ = run(script)
    place = f"train.py:{line_of(script, 'Trainer(model')}"
    acc = next(b for b in ctx.built if b.kind == "Accelerator")
    assert (acc.place, acc.source) == (place, "trainer = Trainer(model, amp=False)")
    assert (acc.via.module, acc.via.qualname) == ("mylib.trainer", "Trainer.__init__") and acc.via.call == "Trainer"
    assert acc.via.params == {"amp": False, "mixed_precision_type": "fp16"}  # lr is not a precision setting
    fix = ctx.precision_fix("bf16")
    assert (fix.kind, fix.place) == ("argument", place)
    assert fix.text == (f"Trainer(..., amp=True, mixed_precision_type='bf16') at {place} (now amp=False, "
                        f"mixed_precision_type='fp16'): Trainer builds the Accelerator inside mylib")
    opt = ctx.optimizer_fix()
    assert (opt.kind, opt.place) == ("code", place)
    assert opt.text.startswith(f"Trainer(...) at {place}: Trainer builds torch.optim.Adam (per-tensor over 4 "
                               f"parameter tensors) inside mylib, and Trainer exposes no fused/foreach parameter")
    assert ctx.frameworks() == [f"accelerate {accelerate.__version__}: Accelerator(mixed_precision='no') built "
                                f"inside mylib's Trainer(...) at {place}"]


def test_autocast_off_is_worded_in_the_scripts_terms_too(tmp_path, monkeypatch):
    """On a CPU that emulates bf16 the fix is fp32: the script's flag set to its no-autocast choice, the
    Accelerator's argument, the launcher's for an Accelerator given none, a library's parameters switched off."""
    script = write(tmp_path / "train.py", ACCELERATE_FLAG)
    ctx, _ = run(script, "--mixed_precision", "bf16", "--steps", "1")
    fix = ctx.precision_fix("fp32")
    assert fix.text == "pass --mixed_precision no (train.py's own flag; this run had 'bf16')"
    assert fix.args == ("--steps", "1", "--mixed_precision", "no")

    AcceleratorState._reset_state(True)
    given = write(tmp_path / "given.py", ACCELERATE_FLAG.replace(
        'p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")', "").replace(
        "mixed_precision=args.mixed_precision", 'mixed_precision="bf16"'))
    ctx, _ = run(given, "--steps", "1")
    place = f"given.py:{line_of(given, 'Accelerator(mixed_precision')}"
    assert ctx.precision_fix("fp32").text == f"Accelerator(mixed_precision='no') at {place} (now mixed_precision='bf16')"

    AcceleratorState._reset_state(True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    unset = write(tmp_path / "unset.py", ACCELERATE_FLAG.replace(
        'p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")', "").replace(
        "mixed_precision=args.mixed_precision, ", ""))
    ctx, _ = run(unset, "--steps", "1")
    assert ctx.precision_fix("fp32").text.endswith(
        "launch it as `accelerate launch --mixed_precision no unset.py --steps 1` (or set "
        "ACCELERATE_MIXED_PRECISION=no): the Accelerator at unset.py:"
        f"{line_of(unset, 'Accelerator(cpu')} is given no mixed_precision, so it takes the launcher's (this run: "
        "'bf16')")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")

    AcceleratorState._reset_state(True)
    lib = tmp_path / "site"
    write(lib / "mylib" / "__init__.py", "from mylib.trainer import Trainer\n")
    write(lib / "mylib" / "trainer.py", LIBRARY)
    monkeypatch.syspath_prepend(str(lib))
    user = write(tmp_path / "proj" / "train.py", """
        import torch
        from mylib import Trainer

        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        trainer = Trainer(model, amp=True, mixed_precision_type="bf16")
        trainer.train(2)
    """)
    ctx, _ = run(user)
    place = f"train.py:{line_of(user, 'Trainer(model')}"
    assert ctx.precision_fix("fp32").text == (
        f"Trainer(..., amp=False, mixed_precision_type='no') at {place} (now amp=True, mixed_precision_type='bf16'): "
        f"Trainer builds the Accelerator inside mylib")
    # a raw torch script with no autocast: nothing to turn off
    ctx, _ = run(write(tmp_path / "raw.py", RAW))
    assert ctx.precision_fix("fp32") is None


def test_raw_torch_script(tmp_path):
    script = write(tmp_path / "train.py", RAW)
    ctx, _ = run(script)
    assert ctx.precision_fix("bf16") is None and ctx.precision_fix("fp16") is None
    assert ctx.compile_fix() is None and ctx.flags == [] and ctx.frameworks() == []
    place = f"train.py:{line_of(script, 'torch.optim.Adam(')}"
    fix = ctx.optimizer_fix()
    assert (fix.kind, fix.place) == ("argument", place)
    assert fix.text.startswith(f"torch.optim.Adam(..., fused=True) at {place} (now foreach=None, fused=None): one "
                               f"fused kernel per step for all 4 parameter tensors")
    loader = next(b for b in ctx.built if b.kind == "DataLoader")
    assert loader.place == f"train.py:{line_of(script, 'DataLoader(ds')}"
    assert (loader.given, loader.effective) == ({"batch_size": 4}, {
        "num_workers": 0, "pin_memory": False, "persistent_workers": False, "batch_size": 4})
    assert ctx.to_dict()["built"][0]["cls"] == "torch.optim.Adam" and json.dumps(ctx.to_dict())


def test_script_switches_are_the_fixes(tmp_path):
    script = write(tmp_path / "train.py", """
        import argparse
        import torch

        p = argparse.ArgumentParser()
        p.add_argument("--fp16", action="store_true")
        p.add_argument("--bf16", action="store_true")
        # as transformers' HfArgumentParser makes a bool field: `--torch_compile` alone sets True
        p.add_argument("--torch_compile", type=lambda s: s == "True", nargs="?", const=True, default=False)
        p.add_argument("--optim", choices=["adamw_torch", "adamw_torch_fused"], default="adamw_torch")
        # flags whose choices or names look like the fixes' but are not them: the weights' dtype, an image size,
        # the processes of datasets.map
        p.add_argument("--torch_dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto")
        p.add_argument("--image_size", type=int, choices=[16, 32], default=16)
        p.add_argument("--preprocessing_num_workers", type=int, default=None)
        p.add_argument("--dataloader_num_workers", type=int, default=0)
        args, _ = p.parse_known_args()
        argparse.ArgumentParser().parse_args([])  # a list of its own, not the command line: not the script's flags
    """, RAW.replace("import torch", ""))
    ctx, _ = run(script, "--fp16", "--extra")
    assert [(f.dest, f.value, f.switch) for f in ctx.flags] == [
        ("fp16", True, True), ("bf16", False, True), ("torch_compile", False, True), ("optim", "adamw_torch", None),
        ("torch_dtype", "auto", None), ("image_size", 16, None), ("preprocessing_num_workers", None, None),
        ("dataloader_num_workers", 0, None)]
    assert ctx.precision_fix("bf16").text == "pass --bf16 (train.py's own switch; off this run)"
    assert ctx.precision_fix("fp16") is None  # --fp16 is on already
    assert ctx.precision_fix("fp32").text.startswith("leave out --fp16")  # not --image_size 32
    assert ctx.compile_fix().text == "pass --torch_compile (train.py's own switch; off this run)"
    fix = ctx.optimizer_fix()
    assert (fix.kind, fix.place) == ("flag", None)
    assert fix.text == "pass --optim adamw_torch_fused (train.py's own flag; this run had 'adamw_torch')"
    fix = ctx.dataloader_fix(4)
    assert (fix.kind, fix.text) == ("flag", "pass --dataloader_num_workers 4 (train.py's own flag; this run had 0)")


@pytest.fixture
def stand_in_transformers(tmp_path, monkeypatch) -> Path:
    """A stand-in transformers (training_args and trainer modules) on sys.path: the folder holding it."""
    if "transformers" in sys.modules:
        pytest.skip("the real transformers is imported in this process")
    lib = tmp_path / "site"
    write(lib / "transformers" / "__init__.py", "__version__ = '0.0-stand-in'\n")
    write(lib / "transformers" / "training_args.py", """
        from dataclasses import dataclass

        @dataclass
        class TrainingArguments:
            output_dir: str
            bf16: bool = False
            fp16: bool = False
            torch_compile: bool = False
            dataloader_num_workers: int = 0
            optim: str = "adamw_torch"

            def __post_init__(self):
                if self.bf16 and self.fp16:
                    raise ValueError("bf16 and fp16 both on")
    """)
    write(lib / "transformers" / "trainer.py", """
        import torch

        class Trainer:
            def __init__(self, model, args, train_dataset):
                self.model, self.args, self.train_dataset = model, args, train_dataset

            def train(self):
                loader = torch.utils.data.DataLoader(self.train_dataset, batch_size=4,
                                                     num_workers=self.args.dataloader_num_workers)
                opt = torch.optim.AdamW(self.model.parameters())
                for x, y in loader:
                    torch.nn.functional.mse_loss(self.model(x), y).backward()
                    opt.step()
    """)
    monkeypatch.syspath_prepend(str(lib))
    return lib


def test_framework_imported_inside_a_library_is_hooked(tmp_path, stand_in_transformers):
    """The stand-in transformers imported only by a library, after entering: the import hook patches
    TrainingArguments when its module finishes importing, and gives the module back its own loader."""
    lib = stand_in_transformers
    write(lib / "mylib" / "__init__.py", "from transformers.training_args import TrainingArguments\n"
                                         "from transformers.trainer import Trainer\n")
    script = write(tmp_path / "proj" / "train.py", """
        import torch
        import mylib
    """, TRAIN, """
        args = mylib.TrainingArguments(output_dir="out", dataloader_num_workers=0)
        mylib.Trainer(model, args, ds).train()
    """)
    ctx, _ = run(script)
    args_place = f"train.py:{line_of(script, 'TrainingArguments(')}"
    ta = next(b for b in ctx.built if b.kind == "TrainingArguments")
    assert (ta.place, ta.via, ta.version) == (args_place, None, "0.0-stand-in")
    assert ctx.precision_fix("bf16").text == (f"TrainingArguments(bf16=True) at {args_place} (now bf16=False, "
                                              f"not passed)")
    assert ctx.compile_fix().text == (f"TrainingArguments(..., torch_compile=True) at {args_place} "
                                      f"(now torch_compile=False)")
    assert ctx.dataloader_fix(2).text == (f"TrainingArguments(..., dataloader_num_workers=2) at {args_place} "
                                          f"(now 0): transformers' Trainer.train builds the DataLoader from it")
    assert ctx.optimizer_fix().place == args_place and "optim='adamw_torch_fused'" in ctx.optimizer_fix().text
    opt = next(b for b in ctx.built if b.kind == "optimizer")
    assert opt.place == f"train.py:{line_of(script, '.train()')}" and opt.via.call == "Trainer.train"
    module = sys.modules["transformers.training_args"]
    assert not isinstance(module.__loader__, _Loader) and not isinstance(module.__spec__.loader, _Loader)
    assert "__wrapped__" not in vars(module.TrainingArguments.__post_init__)


def test_training_arguments_given_are_the_fields_off_their_defaults(tmp_path, stand_in_transformers):
    """TrainingArguments is a dataclass, patched at __post_init__ (which every subclass calls, with no arguments):
    what the script passed is read as the fields whose values differ from their defaults, and the fix is worded
    from them (fp16 passed on: the bf16 fix turns it off)."""
    script = write(tmp_path / "proj" / "train.py", """
        from transformers.training_args import TrainingArguments

        args = TrainingArguments(output_dir="out", fp16=True, dataloader_num_workers=3, bf16=False)
    """)
    ctx, _ = run(script)
    place = f"train.py:{line_of(script, 'TrainingArguments(')}"
    ta = next(b for b in ctx.built if b.kind == "TrainingArguments")
    assert ta.given == {"fp16": True, "dataloader_num_workers": 3}  # bf16=False equals its default: as not passed
    assert ctx.frameworks() == [f"transformers 0.0-stand-in: TrainingArguments(fp16=True, dataloader_num_workers=3) "
                                f"runs bf16=False at {place}"]
    assert ctx.precision_fix("bf16").text == (f"TrainingArguments(bf16=True, fp16=False) at {place} (now bf16=False, "
                                              "not passed)")


def test_lightning_trainer_precision_is_the_fix(tmp_path, monkeypatch):
    """A stand-in pytorch_lightning whose package imports Trainer from trainer/trainer.py (as the real one does),
    first imported by the script: its Trainer(precision=...) is the place."""
    if "pytorch_lightning" in sys.modules:
        pytest.skip("the real pytorch_lightning is imported in this process")
    lib = tmp_path / "site"
    write(lib / "pytorch_lightning" / "__init__.py", "__version__ = '0.0-stand-in'\n"
                                                      "from pytorch_lightning.trainer.trainer import Trainer\n")
    write(lib / "pytorch_lightning" / "trainer" / "__init__.py", "")
    write(lib / "pytorch_lightning" / "trainer" / "trainer.py", """
        class Trainer:
            def __init__(self, *, precision="32-true", max_steps=-1):
                self._precision = {32: "32-true", "32": "32-true"}.get(precision, precision)

            @property
            def precision(self):  # Lightning's: the precision plugin's name for it
                return self._precision
    """)
    monkeypatch.syspath_prepend(str(lib))
    script = write(tmp_path / "proj" / "train.py", """
        import pytorch_lightning as pl

        trainer = pl.Trainer(precision=32, max_steps=3)
    """)
    ctx, _ = run(script)
    place = f"train.py:{line_of(script, 'pl.Trainer(')}"
    fix = ctx.precision_fix("fp16")
    assert (fix.kind, fix.place, fix.text) == ("argument", place, f"Trainer(precision='16-mixed') at {place} "
                                                                   f"(now precision=32)")
    assert ctx.frameworks() == [f"pytorch_lightning 0.0-stand-in: Trainer(precision=32) runs precision='32-true' "
                                f"at {place}"]


def test_every_patch_is_gone_after_exit_even_when_the_script_fails(tmp_path):
    from torch.utils.data import DataLoader

    before = (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args,
              torch.optim.Optimizer.__init__, DataLoader.__init__, accelerate.Accelerator.__init__, list(sys.meta_path))
    script = write(tmp_path / "train.py", RAW + "    raise RuntimeError('the script failed')\n")
    with pytest.raises(RuntimeError, match="the script failed"):
        run(script)
    after = (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args,
             torch.optim.Optimizer.__init__, DataLoader.__init__, accelerate.Accelerator.__init__, list(sys.meta_path))
    assert all(a is b for a, b in zip(before[:5], after[:5]))
    assert len(before[5]) == len(after[5]) and all(a is b for a, b in zip(before[5], after[5]))


def test_the_real_lightning_trainer_precision_is_the_fix(tmp_path, monkeypatch):
    """Lightning itself (a test extra): a LightningModule fitted three steps on the CPU by `L.Trainer(...)`; the hook
    on lightning.pytorch.trainer.trainer sees the Trainer built at the user's line, reads the precision it runs
    ('32-true') and words the fix as its argument there."""
    restore_env_after(monkeypatch, "PYTORCH_NVML_BASED_CUDA_CHECK")  # importing Lightning sets it
    lightning = pytest.importorskip("lightning", reason="Lightning is a test extra: pip install -e '.[test]'")
    script = write(tmp_path / "proj" / "train.py", """
        import lightning as L
        import torch


        class Regressor(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

            def training_step(self, batch, batch_idx):
                x, y = batch
                return torch.nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=1e-3)


        ds = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        loader = torch.utils.data.DataLoader(ds, batch_size=4)
        trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Regressor(), loader)
    """)
    ctx, script_globals = run(script)
    assert script_globals["trainer"].global_step == 3  # the script ran to its end inside the context
    place = f"train.py:{line_of(script, 'L.Trainer(')}"
    fix = ctx.precision_fix("bf16")
    assert (fix.kind, fix.place, fix.text) == ("argument", place, f"Trainer(precision='bf16-mixed') at {place} "
                                                                   "(now precision='32-true', not passed)")
    assert ctx.frameworks()[0].startswith(f"lightning {lightning.__version__}: Trainer(") and place in \
        ctx.frameworks()[0]
