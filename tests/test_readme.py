"""The README as a user reads it: its first bash block is the three commands CI runs, and
its Python example runs as pasted (2 CPU ranks, in a plain script)."""

import os
import re
import subprocess
import sys
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def block(lang: str) -> str:
    return re.search(rf"^```{lang}\n(.*?)^```", README, re.S | re.M).group(1)


def test_first_bash_block_is_install_demo_tests():
    lines = [re.sub(r"\s*#.*$", "", line) for line in block("bash").splitlines()]
    lines = [line for line in lines if line.strip()]
    assert len(lines) == 3
    assert 'pip install "torch==2.13.0"' in lines[0] and 'pip install -e ".[dev,deepspeed]"' in lines[0]
    assert lines[1].startswith("python -m nbtrain demo") and "pytest" in lines[2]


def test_python_example_runs_as_pasted(tmp_path, no_leftovers):
    script = tmp_path / "example.py"
    script.write_text(block("python"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ,
                                                          "NBTRAIN_DASHBOARD": "off"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fsdp holds 2.0× less model state per rank than ddp" in done.stdout, done.stdout
