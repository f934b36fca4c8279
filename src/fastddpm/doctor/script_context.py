"""A user's training script in its own terms: the flags it parses and the framework objects it builds, each with
the line of the user's code that built it, so that `fastddpm doctor run` words a fix where the user can make it:
the script's own flag ("pass --mixed_precision bf16"), the framework argument at the user's line
("Accelerator(mixed_precision='bf16') at train.py:57"), or the library call at the user's line that builds the
object inside ("Trainer(..., amp=True) at train.py:30"), instead of raw torch the user has nowhere to put.

ScriptContext owns, for the length of its `with` only: wrappers on argparse's parse_args/parse_known_args,
torch.optim.Optimizer.__init__, DataLoader.__init__ and the constructors of accelerate's Accelerator, transformers'
TrainingArguments, Lightning's Trainer and diffusers' EMAModel (patched at once when already imported, else right
after their modules finish importing, through a sys.meta_path finder that wraps their loaders; a framework not
installed costs nothing). Each wrapper calls the original with the same arguments and returns its result; exit
undoes it all.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import linecache
import re
import shlex
import sys
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

_FASTDDPM = Path(__file__).resolve().parents[1]
# what a flag's choices call each dtype ('16-mixed' is Lightning's fp16 autocast)
_ALIASES = {"bf16": ("bf16", "bfloat16", "bf16-mixed"), "fp16": ("fp16", "float16", "half", "16", "16-mixed"),
            "fp32": ("no", "fp32", "float32", "32", "32-true")}  # fp32: autocast off
# what is read of each kind of object: these settings as passed (by parameter name) and as they are once built
_SETTINGS = {
    "Accelerator": ("mixed_precision", "gradient_accumulation_steps"),
    "TrainingArguments": ("bf16", "fp16", "torch_compile", "dataloader_num_workers", "optim",
                          "gradient_accumulation_steps", "per_device_train_batch_size"),
    "Trainer": ("precision", "accumulate_grad_batches"),  # Lightning's
    "DataLoader": ("num_workers", "pin_memory", "persistent_workers", "batch_size"),
    "EMAModel": ("foreach",),  # diffusers'
}
# the module that defines each framework class -> (kind, class, method wrapped). The defining module, not the
# package: transformers loads training_args lazily, and hooking the package would force it in.
_FRAMEWORKS = {
    "accelerate.accelerator": ("Accelerator", "Accelerator", "__init__"),
    # a dataclass: subclasses (Seq2SeqTrainingArguments) get their own __init__, but all call __post_init__
    "transformers.training_args": ("TrainingArguments", "TrainingArguments", "__post_init__"),
    "lightning.pytorch.trainer.trainer": ("Trainer", "Trainer", "__init__"),
    "pytorch_lightning.trainer.trainer": ("Trainer", "Trainer", "__init__"),
    "diffusers.training_utils": ("EMAModel", "EMAModel", "__init__"),
}


def _words(name: str) -> list[str]:
    return re.split(r"[_\-]+", name.lower().strip("-"))


def _topic(name: str) -> str | None:
    """Which setting a parameter or flag is about, from the words of its name (`mixed_precision_type` ->
    precision). Whole words, so `num_samples` is not taken for `amp`; `lr` is no optimizer setting."""
    for w in _words(name):
        if w in ("amp", "mixed", "precision", "fp16", "bf16", "autocast"):
            return "precision"
        if w.startswith("compil"):
            return "compile"
        if w == "workers":  # a loader's; not --preprocessing_num_workers (datasets.map's processes)
            return None if {"preprocessing", "preprocess", "tokenizer", "tokenization"} & set(_words(name)) \
                else "workers"
        if w.startswith(("adam", "optim")) or w in ("fused", "foreach"):
            return "optimizer"
    return None


def _kw(d: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in d.items())


def _plain(v):
    """`v` as JSON holds it: what JSON has no type for (a Path, an enum member) as its repr."""
    return json.loads(json.dumps(v, default=repr))


@dataclass(frozen=True)
class ScriptFix:
    text: str  # the sentence to print
    place: str | None  # "file:line" of the user's code to change; None for a flag or a launcher option
    kind: str  # "flag" (pass a flag), "argument" (change an argument at place), "code" (the library decides)
    args: tuple[str, ...] | None = None  # a flag: the script's arguments with it passed (to run it so: --try)


@dataclass
class Flag:
    options: tuple[str, ...]  # ("--mixed_precision",)
    dest: str
    value: Any  # as parsed this run
    default: Any
    choices: tuple | None
    # what passing the option alone sets: store_true True, store_false False, an optional value (nargs='?', as
    # transformers' HfArgumentParser makes bool fields) its const; None: the option takes a value
    switch: Any

    @property
    def option(self) -> str:
        return next((o for o in self.options if o.startswith("--")), self.options[0])


@dataclass
class Via:
    """The library callable the user's line called, inside which the object was built."""
    module: str  # "mylib.trainer"
    qualname: str  # "Trainer.__init__"
    params: dict[str, Any]  # its parameters that name a setting (_topic), with their values in this call

    @property
    def call(self) -> str:  # as the user's line calls it: "Trainer" for Trainer.__init__, else "Trainer.train"
        return self.qualname.removesuffix(".__init__")

    @property
    def package(self) -> str:
        return self.module.split(".")[0]


@dataclass
class Built:
    kind: str  # "Accelerator", "TrainingArguments", "Trainer" (Lightning), "optimizer", "DataLoader"
    framework: str  # "accelerate", "transformers", "lightning", "pytorch_lightning", "torch"
    version: str | None
    cls: str  # the class as the user writes it: "Accelerator", "torch.optim.AdamW"
    given: dict  # the settings as passed
    effective: dict  # the settings once built
    place: str | None  # "file:line" of the first frame out in the user's code; None when none was on the stack
    source: str | None  # that line
    via: Via | None  # set when library code between the constructor and the user's frame built it
    ref: Any = field(default=None, repr=False)  # weakref to the object: optimizer_fix(optimizer) finds it by it
    dataset: int | None = field(default=None, repr=False)  # id() of a DataLoader's dataset


def _settings(kind: str, obj, orig, args, kwargs) -> tuple[dict, dict]:
    """(given, effective) settings of `obj`, just built by orig(obj, *args, **kwargs)."""
    if kind == "optimizer":  # Adam(..., fused=True) keeps what it was given in .defaults
        return ({k: obj.defaults[k] for k in ("foreach", "fused") if k in obj.defaults},
                {"param_tensors": sum(len(g["params"]) for g in obj.param_groups),
                 "fused_supported": "fused" in inspect.signature(type(obj).__init__).parameters})
    effective = {k: getattr(obj, k, None) for k in _SETTINGS[kind]}
    if dataclasses.is_dataclass(obj) and not (args or kwargs):
        # a dataclass patched at __post_init__ (TrainingArguments: every subclass calls it, with no arguments):
        # a setting was given when it differs from its field's default. One passed equal to its default reads as
        # not passed, which words a fix the same way.
        defaults = {f.name: f.default for f in dataclasses.fields(obj) if f.default is not dataclasses.MISSING}
        return {k: v for k, v in effective.items() if k in defaults and v != defaults[k]}, effective
    passed = inspect.signature(orig).bind_partial(obj, *args, **kwargs).arguments
    return {k: passed[k] for k in _SETTINGS[kind] if k in passed}, effective


class _Loader:
    """A module's loader (every attribute but exec_module is the real one's), with `loaded(module)` called right
    after the module's code has run."""

    def __init__(self, loader, loaded):
        self.loader, self.loaded = loader, loaded

    def exec_module(self, module):
        # the real loader goes back before the code runs: nothing of ours outlives the import (linecache, reload)
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.loaded(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class ScriptContext:
    """Enter around running `script` (sys.argv already set for it); read the flags, objects and fixes after."""

    def __init__(self, script: str | Path):
        self.script = Path(script).resolve()
        self.root, self.name = self.script.parent, self.script.name
        self.built: list[Built] = []
        self.errors: list[str] = []  # what could not be read; the script ran on regardless
        self._parses: list[tuple[list[Flag], bool]] = []  # (flags, whether the script itself called the parse)
        self._patches: list[tuple[type, str, Any]] = []
        self._user: dict[str, bool] = {}
        self._active = False
        self._argv: list[str] = []

    def __enter__(self) -> ScriptContext:
        assert not self._active, "a ScriptContext is entered once"
        self._argv = sys.argv[1:]
        self._patch(argparse.ArgumentParser, "parse_args", self._parsed)
        self._patch(argparse.ArgumentParser, "parse_known_args", self._parsed)
        self._patch_class(torch.optim.Optimizer, "__init__", "optimizer")  # subclasses call it through super()
        self._patch_class(torch.utils.data.DataLoader, "__init__", "DataLoader")
        self._active = True
        sys.meta_path.insert(0, self)  # first: it only wraps what the finders after it find
        for name in _FRAMEWORKS:
            if name in sys.modules:  # imported before the script ran
                self._loaded(sys.modules[name])
        return self

    def __exit__(self, *exc) -> bool:
        self._active = False
        sys.meta_path.remove(self)
        for cls, name, orig in reversed(self._patches):
            setattr(cls, name, orig)
        self._patches.clear()
        return False

    def _patch(self, cls: type, name: str, after) -> None:
        """cls.name calls the original, then after(obj, args, kwargs, result, caller frame)."""
        orig = vars(cls)[name]
        errors = self.errors

        # functools.wraps keeps __wrapped__: code that reads a constructor's signature (Lightning re-building a
        # DataLoader, parsers built from __init__) still sees the original's
        @functools.wraps(orig)
        def wrapper(obj, *args, **kwargs):
            result = orig(obj, *args, **kwargs)
            caller = sys._getframe(1)
            try:
                after(obj, args, kwargs, result, caller)
            except Exception as e:  # noqa: BLE001 - the doctor never breaks the user's script: report, go on
                errors.append(f"{type(obj).__name__}.{name}: {type(e).__name__}: {e}")
            finally:
                del caller  # a frame held on to would keep the script's locals alive
            return result

        setattr(cls, name, wrapper)
        self._patches.append((cls, name, orig))

    def _patch_class(self, cls: type, method: str, kind: str) -> None:
        orig = vars(cls)[method]
        self._patch(cls, method, lambda obj, args, kwargs, result, caller:
                    self._record(obj, kind, _settings(kind, obj, orig, args, kwargs), caller))

    def find_spec(self, fullname, path=None, target=None):
        """sys.meta_path's call: for the framework modules only, the spec the finders after this one find, its
        loader wrapped to patch the class once the module has run."""
        if fullname not in _FRAMEWORKS:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self._loaded)
                return spec
        return None

    def _loaded(self, module) -> None:
        if not self._active or module.__name__ not in _FRAMEWORKS:
            return  # a spec our finder wrapped, loaded after exit
        kind, cls, method = _FRAMEWORKS[module.__name__]
        try:
            self._patch_class(getattr(module, cls), method, kind)
        except Exception as e:  # noqa: BLE001 - a class renamed in some version must not fail the import
            self.errors.append(f"{module.__name__}.{cls}: {type(e).__name__}: {e}")

    def _parsed(self, parser, args, kwargs, result, caller) -> None:
        argv = args[0] if args else kwargs.get("args")
        if caller.f_code.co_filename == argparse.__file__ or argv is not None and list(argv) != sys.argv[1:]:
            return  # parse_args's own call of parse_known_args; or a list of its own, not the command line
        ns = result[0] if isinstance(result, tuple) else result
        flags = [Flag(tuple(a.option_strings), a.dest, getattr(ns, a.dest, a.default), a.default,
                      tuple(a.choices) if a.choices is not None else None,
                      True if isinstance(a, argparse.BooleanOptionalAction)
                      else a.const if a.nargs in (0, "?") else None)
                 for a in parser._actions
                 if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]
        self._parses.append((flags, Path(caller.f_code.co_filename).resolve() == self.script))

    def _record(self, obj, kind: str, settings: tuple[dict, dict], caller) -> None:
        frame, inner, place, source, via = caller, None, None, None, None
        while frame is not None and frame.f_locals.get("self") is obj:
            frame = frame.f_back  # the object's own constructors: subclasses' __init__, a dataclass's, decorators
        while frame is not None and not self._is_user(frame.f_code.co_filename):
            inner, frame = frame, frame.f_back
        if frame is not None:
            path = Path(frame.f_code.co_filename).resolve()
            place = f"{path.relative_to(self.root) if path.is_relative_to(self.root) else path}:{frame.f_lineno}"
            source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            via = _via(inner) if inner is not None else None
        top, name = type(obj).__module__.split(".")[0], type(obj).__name__
        cls = f"torch.optim.{name}" if getattr(torch.optim, name, None) is type(obj) else name
        self.built.append(Built(kind, top, getattr(sys.modules.get(top), "__version__", None), cls, *settings,
                                place, source, via, weakref.ref(obj),
                                id(obj.dataset) if kind == "DataLoader" else None))

    def _is_user(self, filename: str) -> bool:
        """The script, or a .py file beside it that is not an installed package or fastddpm."""
        if filename not in self._user:
            p = Path(filename).resolve()  # "<string>" (a dataclass's __init__) is no .py file
            self._user[filename] = p == self.script or (
                p.suffix == ".py" and p.is_relative_to(self.root) and not p.is_relative_to(_FASTDDPM)
                and not {"site-packages", "dist-packages"} & set(p.parts))
        return self._user[filename]

    # --- what was seen ---

    @property
    def flags(self) -> list[Flag]:
        """The flags of the parser that read the command line, preferring one the script called itself."""
        return list(next((f for f, by_script in self._parses if by_script), self._parses[0][0] if self._parses else []))

    def frameworks(self) -> list[str]:
        """One line per framework object: "accelerate 1.15.0: Accelerator(mixed_precision='no') at train.py:57"."""
        out = []
        for b in (b for b in self.built if b.framework != "torch"):
            runs = {k: v for k, v in b.effective.items() if _topic(k) == "precision" and b.given.get(k) != v}
            where = f"built inside {b.via.package}'s {b.via.call}(...) at" if b.via else "at"
            out.append(f"{b.framework} {b.version}: {b.cls}({_kw(b.given)})" + f" runs {_kw(runs)}" * bool(runs)
                       + (f" {where} {b.place}" if b.place else " outside the script"))
        return out

    def to_dict(self) -> dict:
        built = [{k: v for k, v in asdict(b).items() if k not in ("ref", "dataset")} for b in self.built]
        return _plain({"script": str(self.script), "flags": [asdict(f) for f in self.flags], "built": built,
                       "frameworks": self.frameworks(), "errors": self.errors})

    # --- fixes in the script's terms ---

    def precision_fix(self, dtype: str) -> ScriptFix | None:
        """Autocast in `dtype` ("bf16" or "fp16"), or off ("fp32"): the script's flag, else the framework's
        argument at the user's line, else the library call's own parameters, else accelerate's launcher; None when
        none applies."""
        if dtype not in _ALIASES:
            raise ValueError(f"precision_fix: dtype {dtype!r}; give 'bf16', 'fp16' or 'fp32'")
        for f in (f for f in self.flags if _topic(f.dest) == "precision"):  # --mixed_precision {no,fp16,bf16}
            # (not --torch_dtype {float32,bfloat16}, the weights' dtype, nor --image_size {16,32})
            choice = next((c for c in f.choices or () if str(c).lower() in _ALIASES[dtype]), None)
            if choice is not None and f.value != choice:
                return self._flag_fix(f, choice)
        if dtype == "fp32":  # a precision switch that is on (--bf16, --amp): left out
            on = next((f for f in self.flags if f.switch is True and f.value and _topic(f.dest) == "precision"), None)
            if on is not None:
                return ScriptFix(f"leave out {on.option} ({self.name}'s own switch; on this run)", None, "flag",
                                 tuple(_without(self._argv, on.options, takes_value=False)))
        else:  # a switch that is off: --bf16 first, then one for mixed precision in no named dtype (--amp)
            other = "fp16" if dtype == "bf16" else "bf16"
            switches = [f for f in self.flags if f.switch is True and not f.value and _topic(f.dest) == "precision"
                        and other not in _words(f.dest)]
            if switches:
                return self._flag_fix(min(switches, key=lambda f: dtype not in _words(f.dest)))
        for b in self.built:
            fix = self._precision_argument(b, dtype) if b.kind in _SETTINGS and b.place else None
            if fix is not None:
                return fix
        return self._launcher_fix(dtype)

    def _precision_argument(self, b: Built, dtype: str) -> ScriptFix | None:
        arg = _precision_arg(b, dtype)
        if arg is None:
            return None  # a DataLoader, or in dtype already
        unset = b.kind == "Accelerator" and b.given.get("mixed_precision") is None  # the launcher's to set
        if b.via is not None:
            fix = self._via_fix(b, "precision", lambda k, v: _suggest(k, v, dtype), f"the {b.cls}",
                                f"{b.cls}({arg})", off_is_fix=dtype == "fp32")
            return None if unset and fix is not None and fix.kind == "code" else fix  # _launcher_fix words it
        switch = dtype if dtype != "fp32" else "bf16" if b.effective.get("bf16") else "fp16"  # TrainingArguments'
        key = {"Accelerator": "mixed_precision", "TrainingArguments": switch, "Trainer": "precision"}[b.kind]
        now = b.effective.get(key) if b.given.get(key) is None else b.given[key]
        text = f"{b.cls}({arg}) at {b.place} (now {key}={now!r}{', not passed' * (key not in b.given)})"
        if unset:
            text += f"; or, unchanged, {self._launcher_fix(dtype).text}"
        return ScriptFix(text, b.place, "argument")

    def _launcher_fix(self, dtype: str) -> ScriptFix | None:
        # accelerate/state.py, AcceleratorState.__init__: mixed_precision None reads ACCELERATE_MIXED_PRECISION
        # (default 'no'); accelerate/utils/launch.py, prepare_simple_launcher_cmd_env: the launcher's
        # --mixed_precision sets it. A value passed to Accelerator(...) wins, so only an Accelerator given none
        # takes the launcher's.
        mode = "no" if dtype == "fp32" else dtype  # accelerate's name for it
        b = next((b for b in self.built if b.kind == "Accelerator" and b.given.get("mixed_precision") is None
                  and b.effective["mixed_precision"] != mode), None)
        if b is None:
            return None
        cmd = shlex.join(["accelerate", "launch", "--mixed_precision", mode, self.name, *self._argv])
        inside = f"built inside {b.via.call}(...) " if b.via else ""
        return ScriptFix(f"launch it as `{cmd}` (or set ACCELERATE_MIXED_PRECISION={mode}): the Accelerator "
                         f"{inside}at {b.place} is given no mixed_precision, so it takes the launcher's (this run: "
                         f"{b.effective['mixed_precision']!r})", None, "flag")

    def optimizer_fix(self, optimizer: torch.optim.Optimizer | None = None) -> ScriptFix | None:
        """A per-tensor optimizer made fused (foreach where the class has no fused kernel), where it is built.
        `optimizer`: the one that steps (default: the first built)."""
        b = self._find("optimizer", optimizer)
        arg = b and ("fused=True" if b.effective["fused_supported"] else "foreach=True")
        if b is None or b.given.get("fused") or arg == "foreach=True" and b.given.get("foreach"):
            return None
        for f in self.flags:  # --fused_adam, or --optim {adamw_torch,adamw_torch_fused} (transformers' own)
            choice = next((c for c in f.choices or () if "fused" in str(c) and f.value != c), None)
            if f.switch is True and not f.value and "fused" in _words(f.dest) or choice is not None:
                return self._flag_fix(f, choice)
        n = b.effective["param_tensors"]
        if b.via is not None:
            return self._hf_fix(b, "optim", "adamw_torch_fused", "optimizer") or self._via_fix(
                b, "optimizer", lambda k, v: True if {"fused", "foreach"} & set(_words(k)) else None,
                f"{b.cls} (per-tensor over {n} parameter tensors)", f"{b.cls}(..., {arg})")
        return ScriptFix(f"{b.cls}(..., {arg}) at {b.place} (now {_kw(b.given) or 'per-tensor'}): one "
                         f"{'fused kernel' if arg == 'fused=True' else 'multi-tensor op'} per step for all {n} "
                         f"parameter tensors instead of a loop of ops per tensor", b.place, "argument")

    def dataloader_fix(self, num_workers: int, loader=None) -> ScriptFix | None:
        """`num_workers` loader workers: the script's flag, else the DataLoader call where it is built. `loader`:
        the one the loop iterates (default: the first built)."""
        f = next((f for f in self.flags if f.switch is None and _topic(f.dest) == "workers"), None)
        if f is not None:
            return self._flag_fix(f, num_workers) if f.value != num_workers else None
        b = self._find("DataLoader", loader)
        if b is not None and b.via is not None:
            # a framework re-wraps the user's loader (accelerate's prepare() builds a new DataLoader over the same
            # dataset, copying num_workers): the place is the user's own DataLoader over that dataset
            b = next((o for o in self.built if o.kind == "DataLoader" and o.via is None and o.place
                      and o.dataset == b.dataset), b)
        if b is None or b.place is None:
            return None
        if b.via is not None:
            return self._hf_fix(b, "dataloader_num_workers", num_workers, "DataLoader") or self._via_fix(
                b, "workers", lambda k, v: num_workers, "the DataLoader", f"DataLoader(..., num_workers={num_workers})")
        if b.effective.get("num_workers") == num_workers:
            return None
        return ScriptFix(f"DataLoader(..., num_workers={num_workers}) at {b.place} "
                         f"(now num_workers={b.effective['num_workers']})", b.place, "argument")

    def ema_fix(self) -> ScriptFix | None:
        """diffusers' EMAModel updated tensor by tensor (its default, foreach=False) made foreach where the user's
        code builds it."""
        b = self._find("EMAModel", None)
        if b is None or b.place is None or b.effective.get("foreach"):
            return None
        return ScriptFix(f"EMAModel(..., foreach=True) at {b.place} (now foreach={b.effective.get('foreach')!r}): "
                         "its step then updates every tensor in a few torch._foreach ops", b.place, "argument")

    def compile_fix(self) -> ScriptFix | None:
        """torch.compile in the script's terms: its own switch, or TrainingArguments(torch_compile=True)."""
        f = next((f for f in self.flags if f.switch is True and not f.value and _topic(f.dest) == "compile"), None)
        if f is not None:
            return self._flag_fix(f)
        for b in self.built:
            if b.kind == "TrainingArguments" and b.place and not b.effective["torch_compile"]:
                return ScriptFix(f"TrainingArguments(..., torch_compile=True) at {b.place} (now torch_compile="
                                 f"{b.effective['torch_compile']!r})", b.place, "argument")
        return None

    # --- helpers of the fixes ---

    def _find(self, kind: str, obj) -> Built | None:
        return next((b for b in self.built if b.kind == kind and (obj is None or b.ref() is obj)), None)

    def _flag_fix(self, f: Flag, value=None) -> ScriptFix:
        """`pass --flag value`, or with no value the switch `f` (one that passing turns on)."""
        args = tuple(_without(self._argv, f.options, takes_value=value is not None)) + (
            (f.option,) if value is None else (f.option, str(value)))
        if value is None:
            return ScriptFix(f"pass {f.option} ({self.name}'s own switch; off this run)", None, "flag", args)
        return ScriptFix(f"pass {f.option} {value} ({self.name}'s own flag; this run had {f.value!r})", None, "flag",
                         args)

    def _via_fix(self, b: Built, topic: str, suggest, thing: str, raw: str, *,
                 off_is_fix: bool = False) -> ScriptFix | None:
        """The library call at the user's line that built `b`: its `topic` parameters set to suggest(name, value),
        named when no value can be suggested, or, when it has none, said that the library decides. `off_is_fix`:
        switches turned off are the fix (autocast off), not only a side of it."""
        v = b.via
        params = {k: x for k, x in v.params.items() if _topic(k) == topic}
        new = {k: s for k, s in ((k, suggest(k, x)) for k, x in params.items()) if s is not None and s != params[k]}
        inside = f"{v.call} builds {thing} inside {v.package}"
        if new and (off_is_fix or set(new.values()) != {False}):  # the other dtype's switch off alone: no autocast
            return ScriptFix(f"{v.call}(..., {_kw(new)}) at {b.place} (now {_kw({k: params[k] for k in new})}): "
                             f"{inside}", b.place, "argument")
        if params and not new and all(suggest(k, x) is None for k, x in params.items()):
            return ScriptFix(f"{v.call}(..., {_kw(params)}) at {b.place} chooses it: {inside}; set them for {raw}",
                             b.place, "argument")
        if params:
            return None  # its parameters ask for it already
        label = "fused/foreach" if topic == "optimizer" else topic
        return ScriptFix(f"{v.call}(...) at {b.place}: {inside}, and {v.call} exposes no {label} parameter: the "
                         f"choice is {v.package}'s ({raw} in its code)", b.place, "code")

    def _hf_fix(self, b: Built, name: str, value, thing: str) -> ScriptFix | None:
        """transformers' Trainer builds its optimizer and loaders from TrainingArguments: the field, at its line."""
        ta = next((t for t in self.built if t.kind == "TrainingArguments" and t.place), None)
        if b.via.package != "transformers" or ta is None:
            return None
        now = getattr(ta.effective[name], "value", ta.effective[name])  # optim is an enum once built
        return ScriptFix(f"TrainingArguments(..., {name}={value!r}) at {ta.place} (now {now!r}): "
                         f"transformers' {b.via.call} builds the {thing} from it", ta.place, "argument")


def _without(argv: list[str], options: tuple[str, ...], *, takes_value: bool) -> list[str]:
    """`argv` with every use of `options` taken out (`--opt value`, `--opt=value`, or a switch `--opt`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = takes_value
        elif not a.split("=", 1)[0] in options:
            out.append(a)
    return out


def _precision_arg(b: Built, dtype: str) -> str | None:
    """The argument of framework object `b` that turns on `dtype` autocast (or, "fp32", turns autocast off); None
    when it is so already."""
    if dtype == "fp32":
        if b.kind == "Accelerator":
            return None if b.effective.get("mixed_precision") in (None, "no") else "mixed_precision='no'"
        if b.kind == "TrainingArguments":
            return ", ".join(f"{k}=False" for k in ("bf16", "fp16") if b.effective[k]) or None
        if b.kind == "Trainer":
            return None if str(b.effective.get("precision")) in ("32", "32-true", "None") else "precision='32-true'"
        return None
    if b.kind == "Accelerator":
        return None if b.effective["mixed_precision"] == dtype else f"mixed_precision={dtype!r}"
    if b.kind == "TrainingArguments":
        other = "fp16" if dtype == "bf16" else "bf16"
        return None if b.effective[dtype] else f"{dtype}=True" + f", {other}=False" * bool(b.effective[other])
    if b.kind == "Trainer":
        want = "bf16-mixed" if dtype == "bf16" else "16-mixed"  # Lightning's names for autocast
        return None if str(b.effective["precision"]) == want else f"precision={want!r}"
    return None


def _suggest(name: str, value, dtype: str):
    """The value of a library's precision parameter that asks for `dtype`: switches on (the other dtype's off),
    dtype names in; None where the parameter's form is not known (an int). "fp32": switches off, names to no
    autocast."""
    if dtype == "fp32":
        if value is None or isinstance(value, bool):
            return False if value else None
        return ("32-true" if "mixed" in value else "no") if isinstance(value, str) else None
    if ("fp16" if dtype == "bf16" else "bf16") in _words(name):
        return False if value else None
    if value is None or isinstance(value, bool):
        return True
    return (f"{dtype}-mixed" if "mixed" in value else dtype) if isinstance(value, str) else None


def _via(frame) -> Via:
    """The callable running in `frame`, and its setting-like parameters' values there (keyword-only and **kwargs
    included)."""
    code, local = frame.f_code, frame.f_locals
    n = code.co_argcount + code.co_kwonlyargcount
    params = {k: local[k] for k in code.co_varnames[:n] if k in local and _topic(k)}
    if code.co_flags & inspect.CO_VARKEYWORDS:
        extra = local.get(code.co_varnames[n + bool(code.co_flags & inspect.CO_VARARGS)]) or {}
        params.update({k: x for k, x in extra.items() if _topic(k)})
    qual = getattr(code, "co_qualname", None) or (  # co_qualname is Python 3.11's
        f"{type(local['self']).__qualname__}.{code.co_name}" if "self" in local else code.co_name)
    return Via(frame.f_globals.get("__name__", "?"), qual, params)
