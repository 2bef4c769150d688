"""docs/writing-shards.md runs as written: its Python blocks in order, in one interpreter
(a logging pipeline writing with ``write_shards``), then each ``sh`` command, whose output
must contain every line of the ``text`` block that follows it in the guide."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

GUIDE = REPO / "docs" / "writing-shards.md"


def blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def test_the_guide_runs(tmp_path: Path) -> None:
    found = blocks(GUIDE.read_text())
    shards = tmp_path / "interactions"
    env = {
        **os.environ,
        "RTRL_CHECKPOINT_ID": "composer-0",
        "RTRL_SHARDS": shards.as_uri() + "/",
        "RTRL_STAGE_OUT": (tmp_path / "stage").as_uri() + "/",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    program = "\n\n".join(body for language, body in found if language == "python")
    ran = subprocess.run([sys.executable, "-c", program], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    # one interaction matured and was written, under its checkpoint's and hour's partition
    (written,) = [p.relative_to(shards).as_posix() for p in shards.rglob("*.parquet")]
    assert re.fullmatch(
        r"checkpoint=composer-0/date=\d{4}-\d\d-\d\d/hour=\d\d/part-[0-9a-f]{16}-00000\.parquet",
        written,
    ), written
    # The guide's pipeline stamps feedback_at with the clock to the microsecond, and a
    # stage step's time is the clock to the second (as the operator passes --now): a
    # command run within the same second would see that feedback as arriving after the
    # cycle (immature). A reader types the commands seconds later; so does this test.
    time.sleep(1.0)
    commands = 0
    for (language, body), after in zip(found, [*found[1:], ("", "")], strict=True):
        if language != "sh":
            continue
        commands += 1
        result = subprocess.run(["bash", "-c", body], env=env, cwd=REPO, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, f"$ {body}\n{result.stdout}\n{result.stderr}"
        assert after[0] == "text", f"no output shown after: {body}"
        for line in after[1].splitlines():
            assert line in result.stdout + result.stderr, f"$ {body}\nwanted: {line}\n{result}"
    assert commands == 2
