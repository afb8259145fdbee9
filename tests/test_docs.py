"""The README and the guide as a user reads them: the README's first bash block is the
three commands CI runs, and every Python example in README.md and docs/ runs as written,
pasted into the cells of one real kernel in order (the guide continues the README's first
cell), on CPU ranks. An example that needs what a CPU machine lacks (a SLURM cluster, a
job to watch) says so in its first line, and another test runs it where it can run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kernel import Kernel

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "# not run by the tests: "


def blocks(path: Path, lang: str = "python") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), re.S | re.M)


def test_first_bash_block_is_install_demo_tests():
    lines = [re.sub(r"\s*#.*$", "", line) for line in blocks(ROOT / "README.md", "bash")[0]
             .splitlines()]
    lines = [line for line in lines if line.strip()]
    assert len(lines) == 3
    assert 'pip install "torch==2.13.0"' in lines[0] and \
        'pip install -e ".[dev,deepspeed]"' in lines[0]
    assert lines[1].startswith("python -m nbtrain demo") and "pytest" in lines[2]


def test_the_readme_is_for_users_first():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert (ROOT / "docs" / "dashboard.png").stat().st_size > 10_000
    assert "](docs/dashboard.png)" in readme
    assert readme.index("import nbtrain`") < readme.index("## A first cell")  # the trap, early


def test_an_example_not_run_says_why():
    skipped = [(path.name, block.splitlines()[0]) for path in DOCS for block in blocks(path)
               if block.startswith(NOT_RUN)]
    assert len(skipped) <= 3, skipped
    assert all(len(line) > len(NOT_RUN) + 10 for _, line in skipped), skipped


@pytest.mark.kernel
def test_every_example_runs_in_a_kernel(monkeypatch, no_leftovers):
    monkeypatch.setenv("NBTRAIN_DASHBOARD", "off")  # the examples, not the drawing
    kernel = Kernel(startup="pass")
    try:
        outputs = []
        for path in DOCS:
            for i, block in enumerate(blocks(path)):
                if block.startswith(NOT_RUN):
                    continue
                reply = kernel.run(block, timeout=600)
                assert reply.error is None, (f"{path.name}, example {i + 1}:\n{block}",
                                             reply.error["ename"], reply.error["evalue"],
                                             "\n".join(reply.error["traceback"])[-3000:])
                outputs.append(reply.stdout + str(reply.displays) + str(reply.results))
        shown = "\n".join(outputs)
        assert "fsdp holds 2.0× less model state per rank than ddp" in shown
        assert "[(0, 2, '0'), (1, 2, '1')]" in shown  # the torchrun-style function's ranks
        assert "[rank 1] tensor([1., 1.])" in shown  # %%ranks, per rank
    finally:
        kernel.shutdown()
