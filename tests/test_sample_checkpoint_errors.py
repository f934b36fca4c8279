"""`fastddpm sample --checkpoint` of a file that is no checkpoint: one error line naming the file and what fastddpm
reads, never torch's own error text."""

import numpy as np
import pytest

from fastddpm.cli import main


@pytest.mark.parametrize("kind", ["zip", "random", "pickle", "torch-pickle", "cut-short"])
def test_sample_from_a_file_that_is_no_checkpoint_is_one_line_naming_it(tmp_path, capsys, kind):
    """`fastddpm sample --checkpoint x.zip` (or random bytes, a pickle of something else) ends in one line naming the
    file and what fastddpm reads, not torch's own error text."""
    import io
    import pickle
    import zipfile

    import torch

    path = tmp_path / f"x.{'zip' if kind == 'zip' else 'pt'}"
    if kind == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("notes/a.txt", "hello")
    elif kind == "random":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif kind == "pickle":
        path.write_bytes(b"\x80\x04\x95" + bytes(50))  # a pickle header, then nothing a pickle reads
    elif kind == "torch-pickle":
        path.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    else:
        buffer = io.BytesIO()
        torch.save({"w": torch.ones(1000)}, buffer)
        path.write_bytes(buffer.getvalue()[:2000])
    assert main(["sample", "--checkpoint", str(path), "--num-images", "1", "--no-progress"]) == 2
    said = capsys.readouterr()
    lines = said.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], said.err
    for internal in ("PytorchStreamReader", "enforce fail", "In PyTorch 2.6", "Unsupported operand", "magic number",
                     "UserWarning", "Traceback"):
        assert internal not in said.err, said.err
    if kind == "cut-short":
        assert "cut short or damaged" in lines[0] and "earlier checkpoint" in lines[0]
    else:
        assert "not a fastddpm checkpoint" in lines[0] and "a run folder" in lines[0]
        assert "written by `fastddpm train`" in lines[0]
