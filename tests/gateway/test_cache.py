"""The answers the API and the intake reuse: gone after their time, bounded in number."""

from __future__ import annotations

from gateway.cache import ExpiringCache


def test_an_answer_is_reused_until_its_time_is_up() -> None:
    now = [100.0]
    cache = ExpiringCache(seconds=10, clock=lambda: now[0])
    cache.put("token-digest", "alice")
    now[0] = 110.0
    assert cache.get("token-digest") == "alice"
    now[0] = 110.5
    assert cache.get("token-digest") is None
    assert cache.get("never-put") is None


def test_many_distinct_keys_never_grow_it_past_its_bound() -> None:
    now = [0.0]
    cache = ExpiringCache(seconds=10, entries=8, clock=lambda: now[0])
    for n in range(100):
        cache.put(n, n)
        assert len(cache._entries) <= 8
    assert cache.get(99) == 99  # the newest is kept
    now[0] = 5.0
    cache.put("late", 1)
    now[0] = 11.0  # the early ones expired: making room keeps the live one
    for n in range(7):
        cache.put(f"more-{n}", n)
    assert cache.get("late") == 1
