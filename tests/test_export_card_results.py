"""The FID an export's card quotes from `fastddpm eval`: found wherever eval wrote it (its --out, an older result
without the weights' digest) and quoted in every format's card, the diffusers folder's included."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import TINY_DDPM_28, flags
from fastddpm.cli import main

NOT_MEASURED = "- FID: not measured for these weights by the run (`fastddpm eval` measures it)"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, fmnist_npz) -> tuple[Path, Path, dict]:
    """A 2-step ddpm-family run (diffusers can take it) and one `fastddpm eval --out ELSEWHERE` of it: (the run,
    the result's .json, the result)."""
    from fastddpm.eval import classifier, features

    base = tmp_path_factory.mktemp("evaluated")
    run, elsewhere = base / "run", base / "elsewhere"
    assert main(["train", "--data", str(fmnist_npz), "--out", str(run), "--preset", "tiny", *flags(TINY_DDPM_28),
                 "--max-steps", "2", "--num-sample-images", "2", "--sample-steps", "2", "--no-progress"]) == 0
    with pytest.MonkeyPatch.context() as mp:  # the feature network on a short recipe: the FID's value is not checked
        mp.setattr(features, "ClassifierRecipe", lambda: classifier.ClassifierRecipe(epochs=0.05, min_steps=20))
        assert main(["eval", "--checkpoint", str(run), "--num-samples", "10", "--sampler", "ddim", "--steps", "2",
                     "--no-progress", "--out", str(elsewhere)]) == 0
    [path] = elsewhere.glob("eval_*.json")
    return run, path, json.loads(path.read_text())


def _quoted(result: dict, where: str) -> str:
    return (f"- FID {result['fid']:.2f} by `fastddpm eval` of these weights ({where}): ddim 2 steps, 10 samples, "
            f"{result['features']['label']}\n")


def _card(run: Path, out: Path, *flags_: str, fmt: str = "safetensors") -> str:
    assert main(["export", str(run), "--format", fmt, "--out", str(out), *flags_]) == 0
    return (out / "README.md").read_text()


def test_a_result_eval_wrote_elsewhere_is_quoted_through_the_runs_list_or_eval_results(evaluated, tmp_path,
                                                                                       capsys):
    """`eval --out ELSEWHERE` left the run's card saying "not measured". eval now lists the result in the run's
    eval/results_elsewhere.jsonl, which export reads; a result the run does not list (a run folder eval could not
    write, a result copied away) is given with `export --eval-results PATH`, a file or a folder."""
    run, path, result = evaluated
    listed = [json.loads(line) for line in (run / "eval" / "results_elsewhere.jsonl").read_text().splitlines()]
    assert listed == [{"result": str(path), "weights_sha256": result["checkpoint"]["weights_sha256"]}]
    assert not list((run / "eval").glob("eval_*"))  # the result itself went where --out said
    assert _quoted(result, str(path)) in _card(run, tmp_path / "e")

    unlisted = tmp_path / "copy"  # the same run, without the list
    shutil.copytree(run, unlisted)
    (unlisted / "eval" / "results_elsewhere.jsonl").unlink()
    assert NOT_MEASURED in _card(unlisted, tmp_path / "f")
    kept = tmp_path / "kept" / path.name
    kept.parent.mkdir()
    shutil.copyfile(path, kept)
    for given in (kept, kept.parent):
        assert _quoted(result, str(kept)) in _card(unlisted, tmp_path / "g", "--eval-results", str(given))
    # the raw weights are others: given the EMA weights' result, the card says none measured them, and so does the log
    capsys.readouterr()
    assert NOT_MEASURED in _card(unlisted, tmp_path / "h", "--eval-results", str(kept), "--weights", "model")
    assert f"note: --eval-results {kept}: no result there (nor in the run's eval/) is of these weights" in \
        capsys.readouterr().out
    missing = tmp_path / "nowhere.json"
    assert main(["export", str(run), "--format", "safetensors", "--out", str(tmp_path / "i"), "--eval-results",
                 str(missing)]) == 2
    assert f"export --eval-results {missing}: no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "i").exists()


def test_a_result_written_before_eval_recorded_the_digest_is_quoted_where_its_checkpoint_still_holds_these_weights(
        evaluated, tmp_path):
    """A result of the older format (no weights_sha256) was never quoted. Where the checkpoint file it names is
    still there, and not written since the result was, its digest is computed now and the result quoted if it is the
    exported weights'; a file rewritten after the result, or gone, gets none."""
    run0, _, result = evaluated
    run = tmp_path / "run"
    shutil.copytree(run0, run)  # copy2: the checkpoints keep their times, older than the result written below
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / "results_elsewhere.jsonl").unlink(missing_ok=True)  # eval --out listed its result there
    checkpoint = run / Path(result["checkpoint"]["file"]).relative_to(run0)
    old = json.loads(json.dumps(result))
    del old["checkpoint"]["weights_sha256"]  # as eval wrote it before it recorded the digest
    old["checkpoint"]["file"] = str(checkpoint)
    name = "eval/eval_ddim2_n10_seed0_step2.json"
    (run / name).write_text(json.dumps(old))
    assert _quoted(result, f"the run's {name}") in _card(run, tmp_path / "e")
    assert NOT_MEASURED in _card(run, tmp_path / "raw", "--weights", "model")  # the file's other weights

    later = (run / name).stat().st_mtime + 10
    os.utime(checkpoint, (later, later))  # rewritten since (a resume's new branch saves the same step there)
    assert NOT_MEASURED in _card(run, tmp_path / "f")
    old["checkpoint"]["file"] = str(tmp_path / "gone.pt")
    (run / name).write_text(json.dumps(old))
    assert NOT_MEASURED in _card(run, tmp_path / "g")


def test_the_diffusers_card_quotes_the_fid_as_the_other_cards_do(evaluated, tmp_path, fmnist_npz):
    """`export --format diffusers` wrote a card without any FID line, measured or not."""
    run, path, result = evaluated
    card = _card(run, tmp_path / "d", fmt="diffusers")
    assert _quoted(result, str(path)) in card and "not measured" not in card
    fresh = tmp_path / "fresh"  # never evaluated
    assert main(["train", "--data", str(fmnist_npz), "--out", str(fresh), "--preset", "tiny", *flags(TINY_DDPM_28),
                 "--max-steps", "1", "--num-sample-images", "2", "--sample-steps", "2", "--no-progress"]) == 0
    assert NOT_MEASURED in _card(fresh, tmp_path / "f", fmt="diffusers")


def test_a_run_folder_eval_cannot_list_its_result_in_gets_a_note_naming_export_eval_results(evaluated, tmp_path,
                                                                                             capsys, monkeypatch):
    """A run folder eval cannot write (read-only, shared; here its eval/ is a file) keeps the result where --out
    says, and the log names the way export still quotes it."""
    from fastddpm.eval import classifier, features

    monkeypatch.setattr(features, "ClassifierRecipe", lambda: classifier.ClassifierRecipe(epochs=0.05, min_steps=20))
    run = tmp_path / "run"
    shutil.copytree(evaluated[0], run)
    shutil.rmtree(run / "eval")
    (run / "eval").write_text("not a folder")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--num-samples", "10", "--sampler", "ddim", "--steps", "2",
                 "--no-progress", "--out", str(tmp_path / "elsewhere")]) == 0
    [path] = (tmp_path / "elsewhere").glob("eval_*.json")
    assert (f"note: could not list this result in {run / 'eval' / 'results_elsewhere.jsonl'} (File exists), where "
            f"`fastddpm export` of these weights looks for it; give it to export as --eval-results {path}") in \
        capsys.readouterr().out
    assert _quoted(json.loads(path.read_text()), str(path)) in _card(run, tmp_path / "e", "--eval-results", str(path))
