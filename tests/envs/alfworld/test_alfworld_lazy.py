"""Building ALFWorld and listing its tasks never imports its engine (the optional extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENGINE_MODULES = ("textworld", "alfworld", "fast_downward")

SCRIPT = f"""
import json, sys
import contrail.envs as envs
for name in envs.names():
    env = envs.make(name) if name != "babyai" else None  # babyai's test split runs its expert: slow
    if env is not None:
        env.tasks("test"); env.tasks("train", "easy"); env.prompt_messages()
env = envs.make("alfworld", cache_dir=sys.argv[1])
counts = [len(env.tasks(split, level)) for split in ("train", "test") for level in ("easy", "hard")]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {ENGINE_MODULES!r})
print(json.dumps({{"counts": counts, "loaded": loaded}}))
"""


def test_listing_tasks_does_not_import_textworld_or_alfworld(tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    assert sum(report["counts"]) == 6 * (500 + 50)  # the generated catalogue, without generating a game
    assert not any(tmp_path.iterdir())  # and nothing was written to the game cache
