"""Reports and reuse of `fastddpm bench throughput / quality` that a user meets on a second call into a folder, or
with a wrong file name."""

import json

import numpy as np
import pytest

from fastddpm.bench import quality
from fastddpm.bench.quality import QUICK, QualitySettings, run_quality
from fastddpm.bench.throughput_report import report_markdown
from fastddpm.config import ConfigError


def _row(batch: int, tflops: float, gbps: float) -> dict:
    return {"preset": "tiny", "batch_size": batch, "choice": None, "status": "ok", "images_per_s": 50.0,
            "ratio_to_first": 1.0, "step_ms": {"median": 1.0, "min": 1.0, "max": 1.0}, "compile_s": 0.1,
            "mfu_pct": 10.0, "mfu_dtype": "bf16", "mfu_peak_tflops": tflops, "mfu_peak_label": f"measured {tflops}",
            "bandwidth_gbps": gbps, "bandwidth_label": f"copy {gbps}", "roofline_pct": 10.0,
            "roofline_binds": "compute", "peak_memory_gib": None, "recompiles_after_warmup": None,
            "graph_breaks": None, "input_wait_pct": 0.1, "fast_path": {"compile": "off", "cuda_graphs": "off"},
            "parameters": 1000, "precision": "bf16", "gflops_per_image": 0.5, "achieved_tflops": 0.02,
            "mb_per_image": None, "cuda_graphs_failed": None, "input_ms_per_step": 0.1, "final_loss": 0.5}


def test_throughput_report_names_the_peak_each_reused_row_divided_by():
    """A row reused from an earlier call into the folder keeps the peak and bandwidth that call measured; the
    report lists both, not the first row's alone."""
    env = {"git_commit": "abc", "device_name": "cpu", "device": "cpu", "torch_threads": 1, "torch": "t",
           "python": "3", "fastddpm": "0", "command_line": "x", "date_utc": "d"}
    settings = {"precision_resolved": "bf16", "precision_reason": "r", "compile": "auto", "cuda_graphs": "auto",
                "data_placement": "device", "warmup_steps": 1, "repeats": 1, "steps": 1}
    result = {"environment": env, "settings": settings, "notes": [], "runs": [],
              "results": [_row(8, 0.240, 22.7), _row(24, 0.212, 11.7)]}
    md = report_markdown(result)
    assert "peak for MFU (bf16): 0.240 TFLOP/s (measured 0.24), for tiny batch 8" in md
    assert "peak for MFU (bf16): 0.212 TFLOP/s (measured 0.212), for tiny batch 24" in md
    assert "22.7 GB/s (copy 22.7), for tiny batch 8" in md and "11.7 GB/s (copy 11.7), for tiny batch 24" in md
    one = report_markdown({**result, "results": [_row(8, 0.240, 22.7), _row(16, 0.240, 22.7)]})
    assert "peak for MFU (bf16): 0.240 TFLOP/s (measured 0.24)\n" in one and one.count("peak for MFU") == 1


@pytest.mark.parametrize("flag", ["reference_from", "fast_from"])
def test_quality_earlier_file_missing_or_foreign_is_a_config_error(tmp_path, flag):
    base = dict(QUICK, device="cpu", quick=True, **({"options": ("lr-x2",)} if flag == "fast_from" else {}))
    (tmp_path / "quality.md").write_text("# not json\n")
    (tmp_path / "ladder.json").write_text(json.dumps({"schema": "fastddpm-bench-ladder-2"}))
    for path, says in ((tmp_path / "missing.json", "cannot read it"), (tmp_path / "quality.md", "is not JSON"),
                       (tmp_path / "ladder.json", "fastddpm-bench-ladder-2")):
        with pytest.raises(ConfigError, match=says):
            run_quality(QualitySettings(**base, **{flag: str(path)}), tmp_path / "out", argv=["t"],
                        log=lambda m: None)


def test_quality_capped_data_of_two_sources_gets_two_files(tmp_path):
    """The runs' config names the capped data by its file: two --data capped at one count must not share it, or
    the second call into the folder reuses runs trained on the first one's images."""
    rng = np.random.default_rng(0)
    sources = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.npz"
        np.savez(path, x_train=rng.integers(0, 256, (80, 1, 28, 28), dtype=np.uint8),
                 y_train=rng.integers(0, 10, 80).astype(np.int64))
        sources.append(path)
    cache = tmp_path / "cache"
    cache.mkdir()
    got = [quality._data_source(QualitySettings(data=str(p), num_images=64), cache, lambda m: None)[0] for p in sources]
    assert got[0] != got[1]
    again = quality._data_source(QualitySettings(data=str(sources[0]), num_images=64), cache, lambda m: None)[0]
    assert again == got[0]
    with np.load(got[0]) as a, np.load(sources[0]) as src:  # 64 of the source's images and labels, in its order
        rows = {img.tobytes(): i for i, img in enumerate(src["x_train"])}
        index = [rows[img.tobytes()] for img in a["x_train"]]
        assert len(set(index)) == 64 and index == sorted(index)
        assert np.array_equal(a["y_train"], src["y_train"][index])
