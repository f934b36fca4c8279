"""The time-to-quality curve across resumes: the steps a resume trains again replace the abandoned records, and
wall time is the run's whether its checkpoints carried it (wall_s goes on) or not (each process restarted at 0)."""

from fastddpm.eval.curve import cumulative_wall_s, kept_records


def _records(*points):
    return [{"images_seen": i, "wall_s": w, "fid": f} for i, w, f in points]


def test_a_resume_with_the_training_time_carried_keeps_wall_s():
    # evaluations at 96/192/288 images; killed after 288, resumed from the checkpoint at 192 (21 s carried), which
    # trains 192-288 again: the new 288 record replaces the abandoned one
    records = _records((96, 10.0, 9.0), (192, 20.0, 8.0), (288, 30.0, 7.0), (288, 31.5, 7.1), (384, 41.0, 6.0))
    kept = kept_records(records)
    assert [(r["images_seen"], r["wall_s"]) for r in kept] == [(96, 10.0), (192, 20.0), (288, 31.5), (384, 41.0)]
    assert cumulative_wall_s(kept) == [10.0, 20.0, 31.5, 41.0]  # no segment starts: the clock went on


def test_a_resume_from_a_checkpoint_without_the_training_time_continues_the_segment():
    # a checkpoint from before train_s was saved: the new process's wall_s restarts at 0
    kept = kept_records(_records((96, 10.0, 9.0), (192, 20.0, 8.0), (288, 9.0, 7.0)))
    assert cumulative_wall_s(kept) == [10.0, 20.0, 29.0]
