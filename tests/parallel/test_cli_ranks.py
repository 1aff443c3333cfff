"""The command line over several ranks: `kiln run -tp/-pp` starts its own processes
outside torchrun (kiln/cli/ranks.py), `kiln explain -tp/-pp` plans every rank in one
process, compile-only. (`kiln generate -tp -pp`: test_llm_tp.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kiln.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


def _kiln(*argv, cwd=None):
    cmd = [sys.executable, "-c", "import sys; from kiln.cli import main; sys.exit(main())",
           *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def test_run_starts_its_ranks_and_matches_eager():
    done = _kiln("run", "tiny-llama", "-tp", "2", "--size", "seq=6", "--repeat", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 ranks (tp=2 x pp=1) make every call; rank 0 reports" in done.stdout
    (err,) = re.findall(r"rel err vs eager ([0-9.e+-]+)", done.stdout)
    assert float(err) <= 1e-5
    assert done.stdout.count("rel err vs eager") == 1  # only rank 0 prints


def test_a_rank_that_fails_ends_the_run(tmp_path):
    """Rank 1's model fails to build: rank 0, waiting for it to join, stops at once with
    an error naming it rather than at the rendezvous timeout."""
    (tmp_path / "m.py").write_text(
        "import os, torch\n"
        "def model():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise RuntimeError('rank 1 cannot build its model')\n"
        "    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    done = _kiln("run", "m.py:model", "-tp", "2", cwd=tmp_path)
    assert done.returncode == 2
    assert "rank 1 cannot build its model" in done.stderr
    assert "rank 1 of 2 exited with status 2" in done.stderr


def test_explain_plans_every_rank_compile_only(capsys):
    assert main(["explain", "tiny-llama", "-tp", "2", "-pp", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("kiln explain: a tp=2 x pp=2 plan for cpu, 4 devices")
    for rank in range(4):
        assert f"device: rank {rank} of tp=2 x pp=2 (tp rank {rank % 2}, pipeline stage " \
               f"{rank // 2})" in text
    assert text.count("  regions: ") == 4
    assert text.count("all_reduce on 'tp'") >= 4  # every rank's, with its bytes
    assert re.search(r"#\d+ r\d+: all_gather on 'tp', f32\[1, s\d+, 256\], 8 KiB at "
                     r"kiln/models/llama.py:\d+", text)
    assert text.count("send %") >= 2 and text.count("recv %") >= 2  # each stage's transfers
    assert "weights on all 4 devices: " in text


@pytest.mark.parametrize("argv,message", [
    (["-tp", "2", "--rank", "2"], "--rank 2 is outside the 2 ranks of tp=2 x pp=1"),
    (["--rank", "0"], "--rank picks a rank of a multi-device plan"),
    (["-pp", "0"], "--pipeline-parallel-size must be at least 1"),
])
def test_bad_rank_flags(argv, message, capsys):
    assert main(["explain", "tiny-llama", *argv]) == 2
    assert message in capsys.readouterr().err
