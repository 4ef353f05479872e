"""The router's placement, pure: sticky, least-loaded (by requests in flight
and the engines' reported KV-cache use), round robin, engines down or
overloaded."""

from __future__ import annotations

import pytest

from agents.router.placement import KV_FULL, KV_OVERLOADED, NoLiveEngineError, SessionPlacement
from engines.load import EngineLoad

ENGINES = {"e0": "http://a", "e1": "http://b", "e2": "http://c"}


def test_least_loaded_counts_requests_in_flight_before_sessions_held():
    placement = SessionPlacement(ENGINES, "sticky")
    assert placement.pick("s1") == "e0"
    assert placement.pick("s2") == "e1"  # e0 holds a session
    placement.begin("e2")  # e2 busy with a sessionless request
    assert placement.pick("s3") == "e0"  # in flight 0, sessions 1 beats e2's in flight 1
    assert placement.pick("s1") == "e0"  # sticky, whatever the load
    placement.end("e2", prompt_tokens=10, cached_tokens=4)
    stats = placement.stats()
    assert [(e.name, e.sessions, e.in_flight, e.requests) for e in stats.engines] == [
        ("e0", 2, 0, 0),
        ("e1", 1, 0, 0),
        ("e2", 0, 0, 1),
    ]
    assert stats.cache_hit_ratio == 0.4


def test_a_session_on_a_down_engine_moves_and_no_engine_left_is_an_error():
    placement = SessionPlacement(ENGINES, "sticky")
    assert placement.pick("s") == "e0"
    placement.connection_lost("e0", down=False)  # alive: the session stays
    assert placement.pick("s") == "e0"
    placement.connection_lost("e0", down=True)
    assert placement.pick("s") == "e1"
    assert placement.sessions == {"s": "e1"}
    placement.connection_lost("e1", down=True)
    placement.connection_lost("e2", down=True)
    with pytest.raises(NoLiveEngineError, match="no live engine left"):
        placement.pick(None)


def test_round_robin_skips_down_engines_and_ignores_sessions():
    placement = SessionPlacement(ENGINES, "round_robin")
    assert [placement.pick("s") for _ in range(3)] == ["e0", "e1", "e2"]
    placement.connection_lost("e1", down=True)
    assert [placement.pick(None) for _ in range(3)] == ["e0", "e2", "e0"]


def test_an_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="routing must be one of"):
        SessionPlacement(ENGINES, "hash")


def test_an_engine_added_or_back_takes_requests():
    placement = SessionPlacement({"e0": "http://a"}, "round_robin")
    placement.connection_lost("e0", down=True)
    placement.add("e0", "http://a2")  # restarted, a new port
    placement.add("e1", "http://b")
    assert [placement.pick(None) for _ in range(3)] == ["e0", "e1", "e0"]
    assert placement.url("e0") == "http://a2"
    assert [e.alive for e in placement.stats().engines] == [True, True]


def test_a_removed_engine_gets_nothing_and_its_sessions_move():
    placement = SessionPlacement(ENGINES, "sticky")
    assert placement.pick("s1") == "e0"
    placement.begin("e0")  # a request in flight when e0 is removed
    placement.remove("e0")
    placement.end("e0")  # its answer comes back after: nothing to count
    placement.connection_lost("e0", down=True)
    assert [e.name for e in placement.stats().engines] == ["e1", "e2"]
    assert placement.pick("s1") == "e1"


def kv(usage: float, waiting: int = 0) -> EngineLoad:
    return EngineLoad(running=4, waiting=waiting, kv_cache_usage=usage)


def test_a_near_full_engine_takes_new_sessions_only_when_all_are():
    placement = SessionPlacement(ENGINES, "sticky")
    placement.report("e0", kv(KV_FULL))
    placement.report("e1", kv(0.5))
    placement.report("e2", kv(0.2))
    for _ in range(3):
        placement.begin("e2")  # below full, requests in flight decide
    assert placement.pick("s1") == "e1"
    for _ in range(3):
        placement.end("e2")
    assert placement.pick("s2") == "e2"  # none in flight: e1 holds a session
    placement.report("e1", kv(0.9))
    placement.report("e2", kv(0.9))
    assert placement.pick("s3") == "e0"  # all near full: in flight, then sessions held


def test_equal_load_goes_to_the_engine_with_the_least_kv_use():
    placement = SessionPlacement(ENGINES, "sticky")
    placement.report("e0", kv(0.4))
    placement.report("e1", kv(0.1))
    placement.report("e2", kv(0.3))
    assert placement.pick("s") == "e1"


def test_a_session_leaves_its_engine_only_when_it_is_overloaded_and_another_is_not():
    placement = SessionPlacement(ENGINES, "sticky")
    assert placement.pick("s") == "e0"
    placement.report("e0", kv(KV_OVERLOADED))  # full, but nothing waits: stays
    assert placement.pick("s") == "e0"
    for name in ENGINES:
        placement.report(name, kv(KV_OVERLOADED, waiting=2))
    assert placement.pick("s") == "e0"  # every engine overloaded: no move helps
    placement.report("e2", kv(0.3))
    assert placement.pick("s") == "e2"
    assert placement.sessions == {"s": "e2"}


def test_reports_in_the_stats_count_the_prefix_cache_from_the_first_one():
    placement = SessionPlacement({"e0": "http://a"}, "sticky")
    placement.report("e0", EngineLoad(0, 0, 0.0, prefix_cache_queries=50, prefix_cache_hits=10))
    placement.report("e0", EngineLoad(2, 1, 0.6, prefix_cache_queries=250, prefix_cache_hits=170))
    placement.report("e0", EngineLoad(0, 0, 0.1, prefix_cache_queries=450, prefix_cache_hits=310))
    stats = placement.stats()
    (e0,) = stats.engines
    assert (e0.kv_cache_usage, e0.peak_kv_cache_usage) == (0.1, 0.6)
    assert (e0.prefix_cache_queries, e0.prefix_cache_hits, stats.engine_hit_ratio) == (
        400,
        300,
        0.75,
    )
    # restarted: its counters begin again, and so does the router's count
    placement.report("e0", EngineLoad(0, 0, 0.0, prefix_cache_queries=20, prefix_cache_hits=5))
    assert placement.stats().engines[0].prefix_cache_queries == 0
