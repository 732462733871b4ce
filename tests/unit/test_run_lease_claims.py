"""The rule a resume judges checkpoint objects by (dflash_core.train.run_lease.postdates_takeover): trusted when
the current claim wrote it, or when it was written in an earlier second than the claim that took the name from
its writer.

Run: `.venv/bin/python -m pytest tests/unit/test_run_lease_claims.py -q -n 0`
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from dflash_core.train.run_lease import Claim, postdates_takeover

_CLAIMS = (Claim("a", 1000.0), Claim("b", 2000.4), Claim("c", 3000.0))


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


@pytest.mark.parametrize(("writer", "written_at", "taker"), [
    ("c", 9999.0, None),  # the current claim's own
    ("a", 1999.0, None),  # a's, before b took the name
    ("a", 2000.0, "b"),  # in b's claim's second: b may not have seen it
    ("a", 2500.0, "b"),
    ("a", 2999.0, "b"),  # after b's claim, though b's own claim has since been taken too
    ("b", 2999.9, None),
    ("b", 3000.0, "c"),
    (None, 999.0, None),  # unstamped (or of a claim older than the record), before the first recorded claim
    (None, 1000.0, "a"),
    ("z", 1500.0, "a"),
])
def test_an_object_is_trusted_until_its_writer_lost_the_name(writer, written_at, taker) -> None:
    found = postdates_takeover(_CLAIMS, writer=writer, written_at=_at(written_at))
    assert (found.owner if found else None) == taker


def test_no_claims_trust_everything_and_a_claim_of_unknown_time_trusts_nothing_of_its_predecessor() -> None:
    assert postdates_takeover((), writer="a", written_at=_at(5.0)) is None
    assert postdates_takeover((Claim("a", 10.0), Claim("b")), writer="a", written_at=_at(5.0)).owner == "b"
