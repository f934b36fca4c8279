"""`fastddpm bench ladder --quick` on the CPU: the outputs exist, parse, and hold one row per rung with sane
numbers; a planted failing rung is reported failed while the later rungs still run."""

import csv
import json
import math

import pytest

from fastddpm.bench import ladder_rungs
from fastddpm.bench.cli import main as bench_main
from fastddpm.bench.ladder import QUICK, LadderSettings, run_ladder

RUNG_KEYS = ["0", "1", "2", "3", "3b", "4", "5", "6", "7", "8", "9"]
PLANTED = "2"  # this rung's builder raises; rungs after it must still run


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder")
    real = ladder_rungs.prepare_rung

    def planted(rung, sw, ctx):
        if rung.key == PLANTED:
            raise RuntimeError("planted failure")
        return real(rung, sw, ctx)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ladder_rungs, "prepare_rung", planted)
        result = run_ladder(LadderSettings(**QUICK, device="cpu", quick=True), out, argv=["test"], log=lambda m: None)
    return out, result


def test_outputs_exist_and_parse(quick_run):
    out, _ = quick_run
    data = json.loads((out / "ladder.json").read_text())
    assert data["schema"] == "fastddpm-bench-ladder-1"
    assert data["environment"]["command"] == ["test"] and data["environment"]["torch"]
    rows = list(csv.DictReader(open(out / "ladder.csv")))
    assert [r["rung"] for r in rows] == RUNG_KEYS
    assert len(list(csv.DictReader(open(out / "mlp.csv")))) == 4
    md = (out / "ladder.md").read_text()
    assert "## DDPM ladder" in md and "## MLP ladder" in md
    pytest.importorskip("matplotlib")
    assert (out / "ladder.png").stat().st_size > 1000


def test_rows_are_sane(quick_run):
    _, result = quick_run
    rows = {r["rung"]: r for r in result["rungs"]}
    assert list(rows) == RUNG_KEYS
    for key in ("3", "3b", "8"):  # need CUDA
        assert rows[key]["status"] == "skipped" and "cpu" in rows[key]["reason"]
    assert rows["5"]["status"] == "skipped" and "--quick" in rows["5"]["reason"]
    assert rows[PLANTED]["status"] == "failed" and "planted failure" in rows[PLANTED]["reason"]
    ok = [r for r in result["rungs"] if r["status"] == "ok"]
    assert [r["rung"] for r in ok] == ["0", "1", "4", "6", "7", "9"]  # the ladder went on after the failure
    base = rows["0"]["images_per_s"]
    prev = None
    for r in ok:
        assert r["images_per_s"] > 0 and math.isfinite(r["epoch_s"]) and r["epoch_s"] > 0
        assert math.isfinite(r["warmup_s"]) and r["warmup_s"] >= 0 and r["gpu_busy"] is None
        lo, hi = r["images_per_s_range"]
        assert lo <= r["images_per_s"] <= hi
        assert r["epoch_s"] == pytest.approx(result["data"]["num_images"] / r["images_per_s"])
        assert r["speedup_vs_baseline"] == pytest.approx(r["images_per_s"] / base)
        if prev is not None:
            assert r["previous_rung"] == prev["rung"]
            assert r["speedup_vs_previous"] == pytest.approx(r["images_per_s"] / prev["images_per_s"])
        prev = r
    assert rows["4"]["batch_size"] == 3 * rows["0"]["batch_size"]  # 192 / 64, divided alike by --quick


def test_mlp_ladder(quick_run):
    _, result = quick_run
    rows = result["mlp"]["rows"]
    assert [r["rung"] for r in rows] == ["0", "1", "2", "3"]
    for r in rows:
        assert r["status"] == "ok" and r["total_s"] > 0
        assert 0.3 < r["accuracy"] <= 1.0  # 10 classes: chance is 0.1
    assert rows[0]["speedup"] == 1.0
    assert rows[3]["speedup"] == pytest.approx(rows[0]["total_s"] / rows[3]["total_s"])


def test_cli_rejects_bad_flags(capsys):
    assert bench_main(["bench", "ladder", "--preset", "tiny", "--num-images", "10", "--quick"]) == 2
    assert "--num-images" in capsys.readouterr().err
