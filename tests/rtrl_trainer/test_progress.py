"""The progress lines every long step prints: throttled, single lines, rate and ETA, text or
JSON (``rtrl_trainer.progress``); the steps' own lines are tested with each step."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator

import pytest

from rtrl.core.api.progress import duration
from rtrl_trainer import progress
from rtrl_trainer.cli import main
from rtrl_trainer.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def text_format(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(progress.LOG_FORMAT_ENV, raising=False)
    progress.configure(None)
    yield
    progress.configure("text")


def _progress(clock: Clock, out: io.StringIO, **kw: object) -> Progress:
    return Progress("eval", "humaneval, candidate: grading", every=10, clock=clock, out=out, **kw)  # type: ignore[arg-type]


def test_lines_are_throttled_with_rate_and_eta() -> None:
    clock, out = Clock(), io.StringIO()
    p = _progress(clock, out, total=100, unit="problems")
    p.start()
    for _ in range(50):
        clock.now += 1
        p.advance()
    p.end()
    lines = out.getvalue().splitlines()
    # start, the first update, one every 10 s of the 50 s, end
    assert len(lines) == 1 + 1 + 4 + 1, lines
    assert lines[0] == "rtrl-job eval: humaneval, candidate: grading: started, 100 problems"
    assert lines[1] == (
        "rtrl-job eval: humaneval, candidate: grading: 1/100 problems (1%), 1 problems/s, ETA 1m39s"
    )
    assert lines[-2].startswith("rtrl-job eval: humaneval, candidate: grading: 41/100 problems")
    assert lines[-2].endswith("ETA 59s")
    assert lines[-1] == (
        "rtrl-job eval: humaneval, candidate: grading: done, 50/100 problems in 50s, 1 problems/s"
    )


def test_json_lines_parse_and_carry_the_numbers() -> None:
    progress.configure("json")
    clock, out = Clock(), io.StringIO()
    p = _progress(clock, out, total=10, unit="problems", done=2)
    p.start()
    clock.now += 4
    p.update(4, rows=7)
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [d["event"] for d in docs] == ["start", "progress"]
    last = docs[-1]
    assert last["step"] == "eval" and last["done"] == 4 and last["total"] == 10
    assert last["rate"] == 0.5  # 2 done in this run's 4 s: the 2 resumed ones do not count
    assert last["eta_seconds"] == 12.0 and last["counts"] == {"rows": 7}
    assert last["unit"] == "problems" and last["time"].endswith("Z")


def test_no_total_means_no_eta_and_messages_stay_on_one_line() -> None:
    clock, out = Clock(), io.StringIO()
    p = _progress(clock, out)
    clock.now += 2
    p.update(3)
    progress.emit("stage", "note", "two\nlines", out=out)
    lines = out.getvalue().splitlines()
    assert "ETA" not in lines[0] and lines[0].endswith("3 items, 1.5 items/s")
    assert lines[1] == "rtrl-job stage: two lines"


def test_counts_from_many_threads_are_not_lost() -> None:
    p = Progress("eval", "x", total=800, every=1e9, out=io.StringIO())
    threads = [threading.Thread(target=lambda: [p.advance() for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.done == 800


def test_durations() -> None:
    assert [duration(s) for s in (0.4, 59, 61, 3599, 7440)] == [
        "0s",
        "59s",
        "1m01s",
        "59m59s",
        "2h04m",
    ]


def test_a_bad_log_format_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(progress.LOG_FORMAT_ENV, "xml")
    assert main(["stage", "--checkpoint", "c", "--out", "file:///nowhere/"]) == 2
    assert capsys.readouterr().err.strip() == (
        "rtrl-job stage: RTRL_LOG_FORMAT: must be one of text, json, got 'xml'"
    )
    with pytest.raises(SystemExit):
        main(["stage", "--log-format", "xml"])
