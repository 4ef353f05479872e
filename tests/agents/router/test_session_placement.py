"""The router's placement, pure: sticky, least-loaded, round robin, engines down."""

from __future__ import annotations

import pytest

from agents.router.placement import NoLiveEngineError, SessionPlacement

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
