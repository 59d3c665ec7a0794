"""The end-to-end example: three Python worker processes and the orchestrator move real tensors."""

import pathlib
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "pipeline.py"


def test_three_processes_move_real_tensors():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--requests", "8"], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every byte checked; store objects left: 0" in out.stdout


def test_the_readme_rfc_sketch_runs():
    sketch = EXAMPLE.parent / "rfc_sketch.py"
    out = subprocess.run([sys.executable, str(sketch)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "decoded 8 chunks" in out.stdout
