"""The per-principal counts behind `limits.max_sessions_per_principal` (`LegacySessions`): every way
a session comes or goes keeps them exact, and an initialize in flight counts until its session does."""

from __future__ import annotations

import time

from proxy.legacy.session import LegacySessions


def test_initializes_in_flight_count_until_their_session_does() -> None:
    sessions = LegacySessions("s", max_per_principal=2)
    with sessions.opening("a"), sessions.opening("a"):
        assert sessions.counts("a") == (0, 2)
        refusal = sessions.over_cap("a")
        assert refusal is not None and refusal.http_status == 429
        assert refusal.data == {"limit": "max_sessions_per_principal", "max": 2}
        assert "holds 0 sessions on server s and opens 2 more" in refusal.message
        sessions.open("up-1", "a", {}, "2025-11-25")
        assert sessions.counts("a") == (1, 1)  # its session counts, not both
        assert sessions.over_cap("b") is None  # another principal
    assert sessions.counts("a") == (1, 0)
    assert sessions.over_cap("a") is None


def test_every_way_out_uncounts_a_session_once() -> None:
    sessions = LegacySessions("s", max_per_principal=3)
    ended, expired = sessions.open("u1", "a", {}, ""), sessions.open("u2", "a", {}, "")
    sessions.adopt("sid-x", "u3", "a", {}, previous_owner="n2")
    sessions.adopt("sid-x", "u3", "a", {}, previous_owner="n2")  # adopted twice: held once
    assert sessions.counts("a") == (3, 0)
    assert sessions.over_cap("a") is not None
    sessions.end(ended)
    sessions.end(ended)  # ended twice: uncounted once
    assert sessions.counts("a") == (2, 0)
    idle = sessions.get(expired, "a")
    assert idle is not None
    idle.last_used = time.monotonic() - 60
    assert [sid for sid, _ in sessions.expire_idle(30)] == [expired]
    sessions.end("sid-x")
    assert sessions.counts("a") == (0, 0)
