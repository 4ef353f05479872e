"""Each engine's window of shards in flight, set by its load (no Ray)."""

from __future__ import annotations

from engines.load import EngineLoad
from tasks.run.concurrency import KV_HIGH_WATER, EngineWindows

IDLE = EngineLoad(running=4, waiting=0, kv_cache_usage=0.2)


def test_room_grows_the_window_up_to_the_cap():
    windows = EngineWindows(1)
    assert windows.allowed(0, cap=3) == 1
    for _ in range(5):
        windows.finished(0, seconds=1.0, sharing=1, load=IDLE, cap=3)
    assert windows.allowed(0, cap=3) == 3
    assert windows.allowed(0, cap=2) == 2  # a lower cap still binds


def test_waiting_requests_or_a_full_cache_halve_it():
    windows = EngineWindows(1)
    for _ in range(7):
        windows.finished(0, 1.0, 1, IDLE, cap=16)
    assert windows.allowed(0, 16) == 8
    windows.finished(0, 1.0, 1, EngineLoad(8, 3, 0.5), cap=16)
    assert windows.allowed(0, 16) == 4
    windows.finished(0, 1.0, 1, EngineLoad(8, 0, KV_HIGH_WATER), cap=16)
    assert windows.allowed(0, 16) == 2
    for _ in range(3):
        windows.finished(0, 1.0, 1, EngineLoad(8, 3, 0.5), cap=16)
    assert windows.allowed(0, 16) == 1  # never below one: every engine progresses


def test_a_slowed_engine_gets_less_than_a_fast_one():
    windows = EngineWindows(2)
    for _ in range(4):
        windows.finished(0, 1.0, 1, IDLE, cap=8)
        windows.finished(1, 1.0, 1, IDLE, cap=8)
    assert windows.allowed(0, 8) == windows.allowed(1, 8) == 5
    # Engine 1 slows down: its shards take 5x as long, its load looks fine.
    for _ in range(4):
        windows.finished(0, 1.0, 1, IDLE, cap=8)
        windows.finished(1, 5.0, 1, IDLE, cap=8)
    assert windows.allowed(0, 8) == 8
    assert windows.allowed(1, 8) == 1


def test_seconds_count_per_shard_sharing_the_engine():
    windows = EngineWindows(2)
    windows.finished(0, 1.0, 1, IDLE, cap=8)
    # Four shards at once, each taking 4x as long: the same cost per shard.
    windows.finished(1, 4.0, 4, IDLE, cap=8)
    assert windows.allowed(1, 8) == 2


def test_no_report_keeps_the_window_and_a_replacement_starts_over():
    windows = EngineWindows(1)
    windows.finished(0, 1.0, 1, IDLE, cap=8)
    windows.finished(0, 1.0, 1, None, cap=8)
    assert windows.allowed(0, 8) == 2
    windows.reset(0)
    assert windows.allowed(0, 8) == 1
