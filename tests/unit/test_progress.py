"""Byte counts for people: binary units, and bars of the whole job's bytes."""

from __future__ import annotations

import io
import re
import threading

import pytest

from shardwise._progress import ByteBar, JobProgress, human_bytes


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (600 * 2**20, "600.0 MiB"),
        (5 * 2**30, "5.0 GiB"),
        (3 * 2**40, "3.0 TiB"),
        (2**60, "1024.0 PiB"),
    ],
)
def test_human_bytes_uses_binary_units(count, text):
    assert human_bytes(count) == text


def _last_line(output: str) -> str:
    return [part for part in output.split("\r") if part.strip()][-1]


def test_byte_bar_says_the_same_number_as_the_summary():
    out = io.StringIO()
    with ByteBar(600 * 2**20, "saving x", enabled=True, file=out) as bar:
        bar.update(200 * 2**20)
        bar.update(400 * 2**20)
    final = out.getvalue()
    # tqdm's own unit_scale would say "629M" for 600 MiB.
    assert "600.0/600.0 MiB" in _last_line(final), final
    assert human_bytes(600 * 2**20) == "600.0 MiB"
    # (A rate such as "62914560.00MiB/s" may hold the digits; the decimal size may not.)
    assert re.search(r"(?<![\d.])629(\.\d+)?\s?M", final) is None, final


def test_byte_bar_is_silent_without_a_terminal():
    out = io.StringIO()  # not a terminal
    bar = ByteBar(10, "x", file=out)
    bar.update(10)
    bar.close()
    assert out.getvalue() == "" and bar.done == 10


class _Counter:
    def __init__(self) -> None:
        self.value = 0
        self.adds: list[int] = []
        self.removed = False
        self._lock = threading.Lock()

    def add(self, amount: int) -> None:
        with self._lock:
            self.value += amount
            self.adds.append(amount)

    def read(self) -> int | None:
        return self.value

    def remove(self) -> None:
        self.removed = True


def test_job_progress_adds_in_steps_and_the_rest_at_finish():
    counter = _Counter()
    job = JobProgress(100, "x", show=False, counter=counter, step=30)
    for _ in range(10):
        job.update(10)
    assert counter.adds == [30, 30, 30]
    job.finish()
    assert counter.adds == [30, 30, 30, 10] and counter.value == 100
    job.close(succeeded=True)
    assert not counter.removed  # only the drawing rank removes the count


def test_drawing_rank_shows_every_rank_s_bytes(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    counter = _Counter()
    counter.add(3 * 2**20)  # another rank's bytes, already counted
    job = JobProgress(4 * 2**20, "loading c", show=True, counter=counter, interval=0.01)
    job.update(2**20)
    job.close(succeeded=True)
    assert counter.removed
    assert re.search(r"4\.0/4\.0 MiB", _last_line(out.getvalue())), out.getvalue()


def test_failed_job_does_not_claim_completion(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    job = JobProgress(4 * 2**20, "saving c", show=True, counter=None)
    job.update(2**20)
    job.close(succeeded=False)
    assert "4.0/4.0" not in out.getvalue()
    assert "1.0/4.0 MiB" in _last_line(out.getvalue())
