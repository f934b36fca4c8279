"""benchmarks/sdpa_shapes.py on the CPU: it finds a preset's attention shapes, its zero-padded variants compute the
same attention (forward and gradients), and a tiny run writes every shape with the backends this device lacks
recorded as errors, not dropped."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sdpa():
    spec = importlib.util.spec_from_file_location("sdpa_shapes", ROOT / "benchmarks" / "sdpa_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_seed_unets_attention_shapes(sdpa):
    # 4 heads at every level: the head dimension follows the channels, down to 4 at 28x28 in the decoder
    shapes = [(s["tokens"], s["head_dim"], s["calls"]) for s in sdpa.attention_shapes("seed-1layer")]
    assert shapes == [(784, 16, 1), (196, 32, 1), (49, 64, 2), (49, 32, 1), (49, 16, 1), (196, 8, 1), (784, 4, 1)]
    assert all(s["heads"] == 4 for s in sdpa.attention_shapes("seed-1layer"))


@pytest.mark.parametrize("pad_to", [8, 16, 32])
def test_zero_padding_the_head_dimension_is_the_same_attention(sdpa, pad_to):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 49, 4, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    got = sdpa.attention(q, k, v, backend="math", pad_to=pad_to)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-12)
    g = torch.randn_like(want)
    grads_want = torch.autograd.grad(want, (q, k, v), g)
    grads_got = torch.autograd.grad(got, (q, k, v), g)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads_want, grads_got))
    # the scale is what keeps it the same function: padded with the padded size's default scale, it differs
    wrong = torch.nn.functional.scaled_dot_product_attention(
        *(torch.nn.functional.pad(t, (0, pad_to - 4)) for t in (q, k, v)))[..., :4]
    assert not torch.allclose(wrong, want, atol=1e-3)


def test_a_tiny_run_writes_every_shape_and_the_backends_it_cannot_run(sdpa, tmp_path):
    out = tmp_path / "sdpa.json"
    assert sdpa.main(["--presets", "seed-1layer", "--batch-size", "2", "--dtype", "fp32", "--steps", "1",
                      "--repeats", "2", "--pad", "8", "--device", "cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = record["shapes"]["seed-1layer"]
    assert [r["head_dim"] for r in rows] == [16, 32, 64, 32, 16, 8, 4]
    assert record["environment"]["torch"] == torch.__version__ and record["batch_size"] == 2
    for row in rows:
        runs = row["variants"]
        assert len(runs["default"]["ms"]) == 2 and runs["default"]["summary"]["median"] > 0
        assert runs["cudnn"].get("error")  # no cuDNN attention on a CPU: kept, with why
        assert ("default-pad8" in runs) == (row["head_dim"] < 8)
        assert all(r["max_abs_diff"] < 1e-4 for r in runs.values() if "max_abs_diff" in r)
        medians = {n: r["summary"]["median"] for n, r in runs.items() if "summary" in r}
        assert row["best"] == min(medians, key=medians.get)
        assert row["best_vs_default"] == pytest.approx(medians["default"] / medians[row["best"]])
        assert all("max_abs_diff" in r for r in runs.values() if "summary" in r)  # every timed variant checked


def test_the_summary_tabulates_a_run(sdpa, tmp_path):
    spec = importlib.util.spec_from_file_location("summarize_gpu", ROOT / "benchmarks" / "summarize_gpu.py")
    summarize_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize_gpu)
    (tmp_path / "attention").mkdir()
    assert sdpa.main(["--presets", "seed-1layer", "--batch-size", "2", "--dtype", "fp32", "--steps", "1",
                      "--repeats", "1", "--pad", "8", "--device", "cpu",
                      "--out", str(tmp_path / "attention" / "seed-1layer-2.json")]) == 0
    text = summarize_gpu.summarize(tmp_path)
    table = text.split("### Attention at the presets' shapes")[1]
    assert "| 4 x 784 x 4 (1) |" in table and "error" in table and "default-pad8" in table
    assert "Not measured yet (part `attention`)" not in text
