"""benchmarks/soak.py for 45 s against `eejax serve` on a tiny model: every request of the mix
(greedy, sampled, early exit, speculation, n = 2, penalties, echo, shared prefixes, hang-ups,
hostile bodies, deadlines) is answered as it should be, the greedy canaries never change, and
no page is held once idle. (The hour on SmolLM2, with its leak checks, is in docs/serving.md.)"""

import json
import subprocess
import sys

from tests.helpers import ROOT


def test_a_short_soak_answers_everything_and_leaves_nothing_held(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["gqa-untied"][2]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--model", str(path), "--minutes", "0.75"]
    cmd += ["--warm-minutes", "0", "--sample-s", "10", "--rate", "2", "--warmup", "0", "--spec", "1:2"]
    cmd += ["--prompt-scale", "0.25", "--out", str(tmp_path), "--plot", str(tmp_path / "soak.png")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert (tmp_path / "soak.json").exists(), run.stdout + run.stderr
    result = json.loads((tmp_path / "soak.json").read_text())
    checks = result["checks"]
    for name in ("every accepted request answered", "canaries identical", "no page in use when idle"):
        assert checks[name][0], (name, checks[name], run.stdout[-3000:])
    assert all(n > 0 for n in result["requests"].values()), result["requests"]
    assert (tmp_path / "soak.png").stat().st_size > 0
