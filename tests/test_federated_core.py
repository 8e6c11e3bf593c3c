"""The sans-I/O core of federated averaging: staleness, weights, quorum and deadline,
validation, robust rules, membership. Time is passed in; no sockets, no sleeping."""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest

from p2pdist import UsageError
from p2pdist.federated import (
    CloseReason,
    FederatedConfig,
    FederatedRounds,
    Phase,
    Reason,
    aggregate,
    trim_count,
)
from p2pdist.federated.aggregate import apply_update, check_model
from p2pdist.federated.config import MIN_DISCOUNT
from p2pdist.federated.messages import decode, encode
from p2pdist.wire.frames import Frame, FrameKind

F32 = np.dtype(np.float32)


def vec(value: float, n: int = 4) -> np.ndarray:
    return np.full(n, value, np.float32)


def rounds(**kw: object) -> FederatedRounds:
    return FederatedRounds((4,), np.float32, FederatedConfig(**kw))  # type: ignore[arg-type]


def opened(clients: str, **kw: object) -> FederatedRounds:
    """Round 0 open at time 0 with one member per letter of ``clients``."""
    st = rounds(**kw)
    for c in clients:
        st.join(c)
    st.open(0.0)
    return st


def test_stale_update_is_discounted_exactly_per_the_rule() -> None:
    st = rounds(max_staleness=2, discount="polynomial", discount_param=0.5)
    for c in "abc":
        st.join(c)
    st.open(0.0)
    st.close(1.0)  # round 0: nobody
    st.open(1.0)
    st.close(2.0)  # round 1
    st.open(2.0)  # round 2
    assert st.submit("a", 2, 2, 10, vec(1.0), 2.1).accepted  # fresh
    v = st.submit("b", 2, 1, 30, vec(2.0), 2.2)  # staleness 1
    assert v.accepted and v.staleness == 1
    v = st.submit("c", 2, 0, 20, vec(4.0), 2.3)  # staleness 2 == max: still accepted
    assert v.accepted and v.staleness == 2
    out = st.close(3.0)
    w = {p.client: p.weight for p in out.participants}
    assert w == {"a": 10.0, "b": 30 * 2**-0.5, "c": 20 * 3**-0.5}
    expected = (10 * 1.0 + w["b"] * 2.0 + w["c"] * 4.0) / (10 + w["b"] + w["c"])
    assert out.aggregate is not None
    np.testing.assert_array_equal(out.aggregate, vec(expected))
    assert out.stale == 2 and out.applied and out.reason is CloseReason.COMPLETE


def test_update_staler_than_max_staleness_is_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    st = rounds(max_staleness=1)
    st.join("a")
    for t in range(3):  # rounds 0, 1, 2 close empty
        st.open(float(t))
        st.close(float(t) + 0.5)
    st.open(3.0)  # round 3
    with caplog.at_level(logging.INFO, logger="p2pdist.federated.rounds"):
        v = st.submit("a", 3, 1, 5, vec(1.0), 3.1)
    assert not v.accepted and v.reason is Reason.TOO_STALE and v.staleness == 2
    assert "staleness 2 > max_staleness 1" in caplog.text
    assert st.submit("a", 3, 2, 5, vec(1.0), 3.2).accepted  # staleness 1: fine
    out = st.close(4.0)
    assert out.dropped == {"too_stale": 1} and st.totals["too_stale"] == 1
    assert len(out.participants) == 1 and out.participants[0].staleness == 1


@pytest.mark.parametrize(
    ("kind", "param", "s", "factor"),
    [
        ("polynomial", 0.5, 3, 0.5),
        ("polynomial", 1.0, 1, 0.5),
        ("exponential", 0.5, 2, 0.25),
        ("none", 0.5, 5, 1.0),
        ("polynomial", 0.5, 0, 1.0),
    ],
)
def test_staleness_factors(kind: str, param: float, s: int, factor: float) -> None:
    cfg = FederatedConfig(discount=kind, discount_param=param)
    assert cfg.staleness_factor(s) == pytest.approx(factor, rel=1e-15)


def test_straggler_of_round_k_rolls_into_round_k_plus_1_with_its_staleness() -> None:
    st = rounds(max_staleness=1)
    st.join("a")
    st.join("slow")
    st.open(0.0)
    assert st.submit("a", 0, 0, 10, vec(1.0), 0.5).accepted
    out0 = st.close(10.0)  # deadline: the slow client missed it
    assert out0.reason is CloseReason.DEADLINE and [p.client for p in out0.participants] == ["a"]
    np.testing.assert_array_equal(out0.aggregate, vec(1.0))
    st.open(10.0)  # round 1
    v = st.submit("slow", 0, 0, 10, vec(3.0), 10.1)  # sent for round 0, arrives in 1
    assert v.accepted and v.carried and v.staleness == 1
    assert st.submit("a", 1, 1, 10, vec(1.0), 10.2).accepted
    out1 = st.close(11.0)
    ws = 10 * 2**-0.5
    np.testing.assert_allclose(out1.aggregate, vec((10 * 1.0 + ws * 3.0) / (10 + ws)), rtol=1e-6)
    assert out1.stale == 1 and [p.carried for p in out1.participants] == [False, True]
    # with max_staleness 0 the same straggler is dropped instead
    st0 = rounds(max_staleness=0)
    st0.join("a")
    st0.open(0.0)
    st0.close(10.0)
    st0.open(10.0)
    v = st0.submit("a", 0, 0, 10, vec(3.0), 10.1)
    assert not v.accepted and v.reason is Reason.TOO_STALE


def test_quorum_policy_closes_at_quorum_deadline_policy_waits_for_the_slow_client() -> None:
    def run(policy: str) -> list[tuple[float, CloseReason | None]]:
        st = rounds(policy=policy, quorum=0.6, round_timeout=10.0)
        for c in "abcd":
            st.join(c)
        st.open(0.0)
        assert st.needed == 3  # ceil(0.6 * 4)
        seen = []
        for t, c in [(1.0, "a"), (2.0, "b"), (3.0, "c")]:  # "d" is slow
            st.submit(c, 0, 0, 1, vec(1.0), t)
            seen.append((t, st.due(t)))
        seen.append((9.99, st.due(9.99)))
        seen.append((10.0, st.due(10.0)))
        return seen

    q = run("quorum")
    assert q[1][1] is None and q[2][1] is CloseReason.QUORUM
    d = run("deadline")
    assert [r for _, r in d[:-1]] == [None] * 4 and d[-1][1] is CloseReason.DEADLINE


def test_a_straggler_does_not_close_the_next_round_before_the_fresh_updates_come() -> None:
    """Quorum 2 of 4; c and d are slower than the round. Their round-0 updates, arriving
    in round 1, are aggregated with it but do not make its quorum, whatever round they
    name: round 1 waits for two updates from its own model. Counted, they closed round 1
    at once on stale updates alone, the fresh ones then came late in turn, and every
    update stayed stale, round after round (53% accuracy in the example, against 94%
    with the deadline policy; 93% now)."""
    st = rounds(policy="quorum", quorum=2, round_timeout=10.0, max_staleness=2)
    for c in "abcd":
        st.join(c)
    st.open(0.0)
    st.submit("a", 0, 0, 1, vec(1.0), 0.1)
    st.submit("b", 0, 0, 1, vec(1.0), 0.2)
    assert st.due(0.2) is CloseReason.QUORUM
    assert st.close(0.2).applied
    st.open(0.2)
    st.submit("c", 0, 0, 1, vec(1.0), 0.3)  # round 0's, late
    st.submit("d", 1, 0, 1, vec(1.0), 0.35)  # from round 0's model, naming round 1
    assert st.due(0.35) is None  # two updates in, but none from round 1's model
    st.submit("a", 1, 1, 1, vec(1.0), 0.4)
    assert st.due(0.4) is None
    st.submit("b", 1, 1, 1, vec(1.0), 0.5)
    assert st.due(0.5) is CloseReason.QUORUM
    out = st.close(0.5)
    fresh = sorted(p.client for p in out.participants if p.staleness == 0)
    assert out.applied and fresh == ["a", "b"] and out.stale == 2  # c and d ride along


def test_after_a_missed_quorum_updates_from_the_unchanged_model_are_fresh() -> None:
    """Round 0 missed its quorum, so round 1's model is round 0's: updates from it (a
    decentralised rank sends its carried update again, base 0) make round 1's quorum,
    as fresh ones; counted stale, round 1 would wait for its deadline."""
    st = rounds(policy="quorum", quorum=2, round_timeout=10.0, max_staleness=2)
    for c in "abcd":
        st.join(c)
    st.open(0.0)
    st.submit("a", 0, 0, 1, vec(1.0), 0.1)
    assert not st.close(10.0).applied  # one update: short of the quorum
    st.open(10.0)
    st.submit("a", 1, 0, 1, vec(1.0), 10.1)  # sent again for round 1, base 0
    assert st.due(10.1) is None
    st.submit("b", 1, 0, 1, vec(3.0), 10.2)
    assert st.due(10.2) is CloseReason.QUORUM
    assert st.close(10.2).applied
    st.open(10.2)  # round 1 applied: now only updates from round 2's model are fresh
    st.submit("c", 2, 1, 1, vec(1.0), 10.3)
    st.submit("d", 2, 1, 1, vec(1.0), 10.4)
    assert st.due(10.4) is None


def test_a_member_whose_late_update_was_carried_is_waited_for_in_the_next_round() -> None:
    """b joined mid-round 0 and its update for round 0 came after that round closed:
    that carried update is not b's part of round 1. Round 1 waits for b's update for
    it (which replaces the carried one) instead of closing as complete when a's comes;
    b used to stay one round stale for good at the same speed as a (weight x0.707)."""
    st = rounds(round_timeout=10.0, max_staleness=2)
    st.join("a")
    st.open(0.0)
    st.join("b")
    st.submit("a", 0, 0, 1, vec(1.0), 0.1)
    assert st.due(0.1) is CloseReason.COMPLETE  # b joined mid-round: not waited for
    assert st.close(0.1).applied
    st.open(0.1)
    st.submit("b", 0, 0, 1, vec(3.0), 0.15)  # round 0's, carried into round 1
    st.submit("a", 1, 1, 1, vec(1.0), 0.2)
    assert st.due(0.2) is None
    st.submit("b", 1, 1, 1, vec(2.0), 0.25)
    assert st.due(0.25) is CloseReason.COMPLETE
    out = st.close(0.25)
    assert [(p.client, p.staleness) for p in out.participants] == [("a", 0), ("b", 0)]
    assert out.aggregate is not None and out.aggregate.tolist() == [1.5] * 4
    # an old update sent for this round is the member's part (GroupAveraging's
    # step(None) sends a carried update that way)
    st.open(0.25)
    st.leave("b")
    st.submit("a", 2, 2, 1, vec(1.0), 0.3)
    assert st.close(0.3).reason is CloseReason.COMPLETE
    st.join("b")
    st.open(0.3)
    st.submit("a", 3, 3, 1, vec(1.0), 0.4)
    st.submit("b", 3, 2, 1, vec(5.0), 0.41)  # from round 2's model, sent for round 3
    assert st.due(0.41) is CloseReason.COMPLETE


def test_a_carried_update_sent_again_for_the_open_round_is_the_members_part() -> None:
    """a's update for round 0 came after round 0 closed by quorum, so it is carried into
    round 1, but is not a's part of it; a sends the same update again for round 1 (as
    GroupAveraging's step(None) does): that is its part, and with b's fresh update and
    c's word that it has none, round 1 is complete. The resend was refused as a
    duplicate, and round 1 waited for its deadline (an audit)."""
    st = rounds(round_timeout=10.0, policy="quorum", quorum=2)
    for c in "abc":
        st.join(c)
    st.open(0.0)
    st.submit("b", 0, 0, 1, vec(1.0), 0.1)
    st.submit("c", 0, 0, 1, vec(1.0), 0.1)
    assert st.close(0.3, st.due(0.3)).reason is CloseReason.QUORUM
    st.open(0.3)
    assert st.submit("a", 0, 0, 1, vec(3.0), 0.5).carried
    st.submit("b", 1, 1, 1, vec(1.0), 0.6)
    assert st.abstain("c", 1)
    assert st.due(0.6) is None  # a's carried update is not its part of round 1
    again = st.submit("a", 1, 0, 1, vec(3.0), 0.7)
    assert again.accepted and not again.carried, again
    assert st.due(0.7) is CloseReason.COMPLETE
    out = st.close(0.7)
    assert sorted((p.client, p.staleness) for p in out.participants) == [("a", 1), ("b", 0)]
    # Sent again once more, it is a duplicate (it counted once).
    dup = st.submit("a", 1, 0, 1, vec(3.0), 0.8)
    assert not dup.accepted and dup.reason is Reason.DUPLICATE


def test_a_member_slower_than_the_round_is_not_waited_for_round_after_round() -> None:
    """s takes 15 s, round_timeout is 10 s. Round 0 closes at its deadline without it,
    and its late update is its part of round 1 (waiting for its next one would take
    every round to the deadline). s then trains from round 1, the round still open when
    it finished, so its next update (at 30 s) is for round 1 while round 3 is open: it is
    s's part of round 3 too, as round 2 closed at its deadline. Rounds go deadline,
    complete, deadline, complete."""
    st = rounds(round_timeout=10.0, max_staleness=2)
    st.join("a")
    st.join("s")
    st.open(0.0)
    st.submit("a", 0, 0, 1, vec(1.0), 1.0)
    assert st.due(9.0) is None and st.close(10.0).reason is CloseReason.DEADLINE
    st.open(10.0)
    st.submit("a", 1, 1, 1, vec(1.0), 11.0)
    st.submit("s", 0, 0, 1, vec(1.0), 15.0)  # round 0's, after its deadline
    assert st.due(15.0) is CloseReason.COMPLETE
    out = st.close(15.0)
    assert [(p.client, p.staleness) for p in out.participants] == [("a", 0), ("s", 1)]
    st.open(15.0)
    st.submit("a", 2, 2, 1, vec(1.0), 16.0)
    assert st.due(24.0) is None and st.close(25.0).reason is CloseReason.DEADLINE
    st.open(25.0)
    st.submit("a", 3, 3, 1, vec(1.0), 26.0)
    st.submit("s", 1, 1, 1, vec(1.0), 30.0)  # from round 1's model, two rounds late
    assert st.due(30.0) is CloseReason.COMPLETE
    out = st.close(30.0)
    assert [(p.client, p.staleness) for p in out.participants] == [("a", 0), ("s", 2)]
    st.open(30.0)  # round 3 closed complete: a late update is not s's part of round 4
    st.submit("a", 4, 4, 1, vec(1.0), 31.0)
    st.submit("s", 3, 3, 1, vec(1.0), 31.5)
    assert st.due(31.5) is None


def test_a_carried_update_from_the_unchanged_model_is_its_senders_part() -> None:
    """Two rounds short of the quorum leave the model as it was: a's update from round
    0, carried twice, is still from the current model, so it is a's part of round 2."""
    st = opened("ab", quorum=2, max_staleness=2, round_timeout=10.0)
    st.submit("a", 0, 0, 1, vec(1.0), 1.0)
    assert not st.close(10.0).applied
    st.open(10.0)
    assert not st.close(20.0).applied  # b sent nothing either
    st.open(20.0)
    st.submit("b", 2, 2, 1, vec(3.0), 21.0)
    assert st.due(21.0) is CloseReason.COMPLETE
    assert st.close(21.0).applied


def test_round_short_of_quorum_applies_nothing_and_carries_its_updates() -> None:
    st = opened("ab", quorum=2, max_staleness=1)
    st.submit("a", 0, 0, 4, vec(2.0), 1.0)
    out = st.close(10.0)
    assert not out.applied and out.aggregate is None and len(out.participants) == 1
    st.open(10.0)
    st.submit("b", 1, 1, 4, vec(4.0), 11.0)
    out = st.close(12.0)  # "a"'s update counts now, one round staler
    assert out.applied and [p.staleness for p in out.participants] == [1, 0]
    st.open(12.0)
    out = st.close(22.0)
    assert not out.applied


@pytest.mark.parametrize("policy", ["deadline", "quorum"])
def test_a_carried_update_too_stale_for_the_next_round_does_not_close_it(policy: str) -> None:
    """A round that missed its quorum carries "a"'s update; with max_staleness=0 the next
    round may not count it. It must not make that round look complete (or quorate) as
    soon as "b" submits: it used to close at once, applying nothing, and "a"'s fresh
    update went to the round after."""
    st = opened("ab", quorum=2, max_staleness=0, policy=policy, round_timeout=10.0)
    st.submit("a", 0, 0, 4, vec(2.0), 1.0)
    assert not st.close(10.0).applied
    st.open(10.0)
    st.submit("b", 1, 1, 4, vec(4.0), 11.0)
    assert st.due(11.0) is None  # still waiting for "a"
    st.submit("a", 1, 1, 4, vec(2.0), 12.0)
    out = st.close(12.0)
    assert out.applied and [p.client for p in out.participants] == ["a", "b"]
    assert out.dropped == {"too_stale": 1}


def test_a_round_whose_members_cannot_meet_the_quorum_waits_for_its_deadline() -> None:
    """Every member submitted, but they are fewer than the quorum: the round waits for its
    deadline (a joiner may bring the rest) instead of closing as complete, and the next
    round does not close as it opens on the carried updates alone."""
    st = opened("ab", quorum=3, round_timeout=10.0)
    st.submit("a", 0, 0, 1, vec(1.0), 0.1)
    st.submit("b", 0, 0, 1, vec(1.0), 0.2)
    assert st.due(0.3) is None
    assert st.due(10.0) is CloseReason.DEADLINE
    assert not st.close(10.0).applied
    st.open(10.0)  # both updates carried in: still not complete
    assert st.due(10.0) is None
    st.join("c")
    st.submit("c", 1, 1, 1, vec(4.0), 11.0)
    assert st.due(11.0) is not None
    out = st.close(11.0)
    assert out.applied and len(out.participants) == 3


def test_fraction_quorum_rounds_up_and_needs_one() -> None:
    assert FederatedConfig(quorum=0.5).needed(5) == 3
    assert FederatedConfig(quorum=0.5).needed(4) == 2
    assert FederatedConfig(quorum=0.1).needed(0) == 1
    assert FederatedConfig(quorum=3).needed(10) == 3


@pytest.mark.parametrize(
    ("update", "samples", "reason"),
    [
        (np.array([1.0, np.nan, 0, 0], np.float32), 5, Reason.NONFINITE),
        (np.array([1.0, np.inf, 0, 0], np.float32), 5, Reason.NONFINITE),
        (np.zeros(5, np.float32), 5, Reason.SHAPE),
        (np.zeros(4, np.float64), 5, Reason.DTYPE),
        (np.full(4, 100.0, np.float32), 5, Reason.NORM),
        (np.zeros(4, np.float32), 0, Reason.SAMPLES),
        (np.zeros(4, np.float32), 10**9, Reason.SAMPLES),
        (np.zeros(4, np.float32), 2.5, Reason.SAMPLES),
    ],
)
def test_invalid_updates_are_rejected_logged_and_counted_and_the_round_goes_on(
    update: np.ndarray, samples: object, reason: Reason, caplog: pytest.LogCaptureFixture
) -> None:
    st = rounds(max_norm=10.0, max_num_samples=1000)
    st.join("bad")
    st.join("good")
    st.open(0.0)
    with caplog.at_level(logging.WARNING, logger="p2pdist.federated.rounds"):
        v = st.submit("bad", 0, 0, samples, update, 0.1)
    assert not v.accepted and v.reason is reason and reason.is_rejection
    assert f"rejected update from bad: {v.detail}" in caplog.text
    assert st.submit("good", 0, 0, 3, vec(0.5), 0.2).accepted
    out = st.close(10.0)
    assert out.rejected == {reason.value: 1} and out.num_rejected == 1
    np.testing.assert_array_equal(out.aggregate, vec(0.5))


def test_duplicates_future_rounds_and_superseding() -> None:
    st = rounds(max_staleness=3)
    st.join("a")
    for t in range(2):
        st.open(float(t))
        st.close(t + 0.5)
    st.open(2.0)  # round 2
    assert st.submit("a", 3, 2, 1, vec(1.0), 2.0).reason is Reason.FUTURE
    assert st.submit("a", 1, 2, 1, vec(1.0), 2.0).reason is Reason.TOO_STALE  # base > round
    assert st.submit("a", 1, 0, 1, vec(1.0), 2.0).accepted  # straggler
    assert st.submit("a", 2, 2, 1, vec(5.0), 2.1).accepted  # fresher: supersedes it
    assert st.submit("a", 2, 2, 1, vec(9.0), 2.2).reason is Reason.DUPLICATE
    out = st.close(3.0)
    np.testing.assert_array_equal(out.aggregate, vec(5.0))
    assert out.dropped == {"future_round": 1, "too_stale": 1, "superseded": 1, "duplicate": 1}


def test_an_update_resent_after_its_round_closed_counts_once() -> None:
    st = opened("ab", max_staleness=2)
    assert st.submit("a", 0, 0, 10, vec(1.0), 0.1).accepted
    assert [p.client for p in st.close(1.0).participants] == ["a"]
    # "a" sends the same update again (its ack was lost, it reconnected): with the round
    # it sent it for, or with the newest round it has heard of
    for r in (0, 1):
        v = st.submit("a", r, 0, 10, vec(1.0), 1.1)
        assert not v.accepted and v.reason is Reason.DUPLICATE, v
    st.open(2.0)
    assert st.submit("b", 1, 1, 10, vec(-1.0), 2.1).accepted
    assert st.submit("a", 1, 0, 10, vec(1.0), 2.2).reason is Reason.DUPLICATE
    out = st.close(3.0)
    assert [p.client for p in out.participants] == ["b"]
    np.testing.assert_array_equal(out.aggregate, vec(-1.0))
    assert out.dropped == {"duplicate": 3}
    st.open(4.0)  # round 2: still within max_staleness of base 0, still refused
    assert st.submit("a", 0, 0, 10, vec(1.0), 4.1).reason is Reason.DUPLICATE
    assert st.submit("a", 2, 1, 10, vec(3.0), 4.2).accepted  # a newer base counts
    out = st.close(5.0)
    assert [(p.client, p.base_round) for p in out.participants] == [("a", 1)]
    assert st.totals["duplicate"] == 4
    # what is remembered is bounded: a base is forgotten once the staleness bound alone
    # refuses it (round 4 - base 1 > 2), and a resend is then told too_stale
    assert st._aggregated == {"a": 1, "b": 1}
    st.open(6.0)
    st.close(6.5)
    assert st._aggregated == {}
    assert st.submit("a", 2, 1, 10, vec(3.0), 9.0).reason is Reason.TOO_STALE


def test_a_new_leader_seeded_from_the_last_decision_refuses_an_update_resent_to_it() -> None:
    from p2pdist.federated.decision import cid, counted_of, decision_body, remembered

    cfg = FederatedConfig(max_staleness=2)
    old = FederatedRounds((4,), np.float32, cfg)
    for r in range(3):
        old.join(cid(r))
    old.open(0.0)
    for r in range(3):
        assert old.submit(cid(r), 0, 0, 10, vec(float(r)), 0.1).accepted
    assert old.close(1.0).applied
    # the decision of round 0, as the leader sends it and a follower reads it; then the
    # leader is lost and a follower takes over from round 1 with what it counted
    fields = {
        "r": 0,
        "ok": True,
        "why": "complete",
        "p": [[r, 0, 10, 10.0, bytes(16)] for r in range(3)],
        "refused": [],
        "stale": 0,
        "dropped": {},
        "rejected": {},
        "cfg": ["mean", 0.2, 1.0],
        "left": [],
        "counted": counted_of(old.aggregated),
    }
    meta, _ = encode("decision", fields)
    message = decode(Frame(FrameKind.DATA, 0, 0, meta, memoryview(b"")), "leader")
    body = decision_body(message, "leader", 0, 3)
    assert body["counted"] == [[0, 0], [1, 0], [2, 0]]
    new = FederatedRounds((4,), np.float32, cfg, first_round=1, aggregated=remembered(body))
    for r in range(3):
        new.join(cid(r))
    new.open(2.0)
    # rank 2 sends its aggregated update of base 0 again, now to the new leader
    v = new.submit(cid(2), 1, 0, 10, vec(2.0), 2.1)
    assert not v.accepted and v.reason is Reason.DUPLICATE, v
    assert new.submit(cid(1), 1, 1, 10, vec(1.0), 2.2).accepted  # a newer base counts
    out = new.close(3.0)
    assert [p.client for p in out.participants] == [cid(1)] and out.dropped == {"duplicate": 1}
    assert counted_of(new.aggregated) == [[0, 0], [1, 1], [2, 0]]
    # the same bound as the old leader's: base 0 is forgotten once round 3 opens
    new.open(4.0)
    assert new.close(5.0).round == 2 and counted_of(new.aggregated) == [[1, 1]]
    assert new.submit(cid(2), 3, 0, 10, vec(2.0), 6.0).reason is Reason.TOO_STALE
    # seeding applies that bound too, and before any decision there is nothing to seed
    late = FederatedRounds((4,), np.float32, cfg, first_round=3, aggregated=remembered(body))
    assert late.aggregated == {} and remembered(None) == {}


def test_an_update_carried_without_an_aggregate_may_be_sent_again() -> None:
    st = opened("ab", quorum=2, max_staleness=2)
    assert st.submit("a", 0, 0, 10, vec(1.0), 0.1).accepted
    assert not st.close(1.0).applied  # quorum missed: nothing was aggregated
    assert [c.client for c in st.take_pending()] == ["a"]
    st.open(2.0)  # its owner sends it again (decentralised): it counts, once
    assert st.submit("a", 1, 0, 10, vec(1.0), 2.1).accepted
    assert st.submit("b", 1, 1, 10, vec(1.0), 2.2).accepted
    out = st.close(3.0)
    assert out.applied and [p.client for p in out.participants] == ["a", "b"]
    st.open(4.0)
    assert st.submit("a", 1, 0, 10, vec(1.0), 4.1).reason is Reason.DUPLICATE


def test_leaving_mid_round_never_blocks_and_joiners_count_from_the_next_round() -> None:
    st = opened("abc", round_timeout=100.0)
    st.submit("a", 0, 0, 1, vec(1.0), 1.0)
    st.submit("b", 0, 0, 1, vec(1.0), 2.0)
    assert st.due(3.0) is None
    st.join("late")  # joins mid-round: not waited for
    st.leave("c")  # disconnects mid-round
    assert st.due(3.0) is CloseReason.COMPLETE
    out = st.close(3.0)
    assert out.members == 3
    st.open(3.0)
    st.submit("a", 1, 1, 1, vec(1.0), 4.0)
    st.submit("b", 1, 1, 1, vec(1.0), 4.0)
    assert st.due(4.0) is None  # now "late" is a member of the round
    st.submit("late", 1, 1, 1, vec(1.0), 5.0)
    assert st.due(5.0) is CloseReason.COMPLETE


def test_empty_round_waits_for_its_deadline() -> None:
    st = rounds(round_timeout=5.0)
    assert st.open(1.0) == 6.0
    assert st.due(5.9) is None and st.due(6.0) is CloseReason.DEADLINE
    out = st.close(6.0)
    assert not out.applied and st.phase is Phase.WAITING and st.round == 1
    with pytest.raises(UsageError):
        st.close(7.0)


def test_submissions_between_rounds_count_in_the_next_one() -> None:
    st = rounds()
    st.join("a")
    assert st.submit("a", 0, 0, 2, vec(3.0), 0.0).accepted  # round 0 not opened yet
    st.open(1.0)
    assert st.due(1.0) is CloseReason.COMPLETE
    np.testing.assert_array_equal(st.close(1.0).aggregate, vec(3.0))


def test_weighted_mean_uses_sample_counts() -> None:
    xs = [vec(1.0), vec(2.0), vec(10.0)]
    out = aggregate(xs, [1.0, 1.0, 2.0], "mean", 0.0, F32)
    np.testing.assert_array_equal(out, vec(23.0 / 4))
    assert out.dtype == F32


def test_robust_rules_ignore_an_update_scaled_by_a_million() -> None:
    rng = np.random.default_rng(0)
    honest = [rng.normal(1.0, 0.1, 1000).astype(np.float32) for _ in range(6)]
    evil = (honest[0] * 1e6).astype(np.float32)
    ups = [*honest, evil]
    w = [1.0] * 7
    truth = np.mean(honest, axis=0)
    mean = aggregate(ups, w, "mean", 0.0, F32)
    med = aggregate(ups, w, "median", 0.0, F32)
    trim = aggregate(ups, w, "trimmed_mean", 0.2, F32)
    assert float(np.abs(mean - truth).max()) > 1e4
    assert float(np.abs(med - truth).max()) < 0.5
    assert float(np.abs(trim - truth).max()) < 0.5
    assert trim_count(7, 0.2) == 1 and trim_count(2, 0.4) == 0 and trim_count(3, 0.49) == 1


def test_median_of_even_count_and_trimmed_mean_by_hand() -> None:
    xs = [np.array([v], np.float64) for v in (4.0, 1.0, 3.0, 2.0)]
    assert aggregate(xs, [1] * 4, "median", 0.0, np.dtype(np.float64))[0] == 2.5
    xs5 = [np.array([v], np.float64) for v in (100.0, 1.0, 3.0, 2.0, -50.0)]
    assert aggregate(xs5, [1] * 5, "trimmed_mean", 0.2, np.dtype(np.float64))[0] == 2.0


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.uint8])
@pytest.mark.parametrize("rule", ["mean", "median", "trimmed_mean"])
def test_an_aggregate_owns_its_memory_not_the_stack_of_updates(rule: str, dtype: type) -> None:
    """An odd-count median is one row of the sorted stack of every update: returned as a
    view, the model kept n times its size alive for as long as it lived."""
    xs = [np.full((3, 4), v, dtype) for v in (5, 1, 3)]
    out = aggregate(xs, [1] * 3, rule, 0.0, np.dtype(dtype))
    assert out.shape == (3, 4) and out.dtype == dtype and int(out[0, 0]) == 3
    assert out.base is None or out.base.nbytes == out.nbytes


def test_aggregate_bits_do_not_depend_on_the_machine_order_only_on_the_input_order() -> None:
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(999).astype(np.float32) for _ in range(5)]
    ws = [3.0, 1.0, 7.0, 2.0, 5.0]
    a = aggregate(xs, ws, "mean", 0.0, F32)
    b = aggregate([x.copy() for x in xs], list(ws), "mean", 0.0, F32)
    assert a.tobytes() == b.tobytes()
    # the documented arithmetic, bit for bit: elementwise float64 in the order given,
    # divided by the sum of the weights, rounded once
    acc = np.zeros(999, np.float64)
    for x, w in zip(xs, ws, strict=True):
        acc += x.astype(np.float64) * w
    assert a.tobytes() == (acc / sum(ws)).astype(np.float32).tobytes()


def test_config_validation() -> None:
    for bad in (
        {"quorum": 0},
        {"quorum": 1.5},
        {"quorum": True},
        {"policy": "whenever"},
        {"rule": "mode"},
        {"discount": "exponential", "discount_param": 2.0},
        {"trim_fraction": 0.5},
        {"round_timeout": 0},
        {"max_staleness": -1},
        {"max_norm": 0.0},
    ):
        with pytest.raises(UsageError):
            FederatedConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"max_staleness": 1.5},
        {"max_staleness": 2.0},
        {"max_staleness": True},
        {"max_staleness": "2"},
        {"server_lr": 0},
        {"server_lr": -1},
        {"server_lr": float("nan")},
        {"server_lr": float("inf")},
        {"server_lr": "1"},
        {"round_timeout": float("nan")},
        {"round_timeout": True},
        {"round_timeout": "5"},
        {"discount_param": float("nan")},
        {"discount_param": float("inf")},
        {"discount_param": "0.5"},
        {"discount": "none", "discount_param": None},
        {"trim_fraction": float("nan")},
        {"trim_fraction": "0.2"},
        {"max_norm": float("nan")},
        {"max_norm": -1.0},
        {"max_norm": "10"},
        {"max_num_samples": 0},
        {"max_num_samples": 10.5},
        {"max_num_samples": True},
        {"quorum": float("nan")},
    ],
)
def test_config_refuses_wrong_types_and_values(bad: dict[str, object]) -> None:
    # docs §8: bad values raise UsageError (never a TypeError, never accepted)
    with pytest.raises(UsageError, match=next(iter(bad))):
        FederatedConfig(**bad)  # type: ignore[arg-type]


def test_config_accepts_numpy_numbers_and_the_edges() -> None:
    cfg = FederatedConfig(
        round_timeout=np.float32(0.5),  # type: ignore[arg-type]
        max_staleness=np.int64(0),  # type: ignore[arg-type]
        server_lr=0.1,
        trim_fraction=0.0,
        max_num_samples=1,
        max_norm=float("inf"),
    )
    assert cfg.max_staleness == 0 and cfg.server_lr == 0.1
    # numpy scalars are kept as Python numbers: the settings travel in msgpack messages
    # (a coordinator's round deadline, a leader's decision) and are compared across ranks
    assert type(cfg.round_timeout) is float and type(cfg.max_staleness) is int
    numpy_cfg = FederatedConfig(
        quorum=np.int64(3),  # type: ignore[arg-type]
        trim_fraction=np.float32(0.25),  # type: ignore[arg-type]
        server_lr=np.float64(0.5),  # type: ignore[arg-type]
        discount_param=np.float32(0.5),  # type: ignore[arg-type]
    )
    assert type(numpy_cfg.quorum) is int and numpy_cfg.quorum == 3
    fields = [numpy_cfg.trim_fraction, numpy_cfg.server_lr, numpy_cfg.discount_param]
    assert all(type(v) is float for v in fields)
    assert msgpack.unpackb(msgpack.packb(fields)) == [0.25, 0.5, 0.5]


def test_a_coordinator_error_stop_is_bounded_and_survives_a_broken_str() -> None:
    from p2pdist.federated.coordinator import _describe

    class Odd(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert _describe(Odd()) == "Odd: (no description)"
    long = _describe(ValueError("x" * 100_000))
    assert long.startswith("ValueError: x") and len(long) == 1000


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=">f8").reshape(3, 4),  # big-endian
        np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],  # not contiguous
        np.array(2.5, np.float32),  # 0-d stays 0-d
        np.zeros((0, 3), np.int16),
    ],
)
def test_message_arrays_round_trip_whatever_their_layout(array: np.ndarray) -> None:
    meta, payload = encode("submit", {"r": 1}, array)
    frame = Frame(FrameKind.DATA, 0, 0, meta, memoryview(bytes(payload)))
    got = decode(frame, "client x")
    assert got.kind == "submit" and got.fields == {"r": 1}
    arr = got.need_array("client x")
    assert arr.shape == array.shape and arr.dtype == array.dtype.newbyteorder("<")
    np.testing.assert_array_equal(arr, array)


def test_message_refuses_arrays_that_cannot_travel() -> None:
    with pytest.raises(UsageError, match="cannot travel"):
        encode("submit", {}, np.array(["text"], dtype=object))


def test_a_client_refused_again_and_again_is_logged_once_per_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    st = rounds()
    st.join("a")
    st.open(0.0)
    with caplog.at_level(logging.DEBUG, logger="p2pdist.federated.rounds"):
        for _ in range(100):
            assert not st.submit("a", 0, 0, 1, vec(1.0, 5), 0.1).accepted  # wrong shape
        st.close(1.0)
        st.open(2.0)
        assert not st.submit("a", 1, 1, 1, vec(1.0, 5), 2.1).accepted
    refused = [r for r in caplog.records if "rejected update from a" in r.getMessage()]
    assert len(refused) == 101
    assert [r.levelno for r in refused].count(logging.WARNING) == 2  # round 0 and round 1
    assert st.totals["shape"] == 101  # every one counted


def test_a_numpy_integer_sample_count_counts_as_an_int() -> None:
    """``mask.sum()`` is a numpy integer: accepted as the count it is; the refusal of a
    count out of bounds names the real bound."""
    st = rounds(max_num_samples=100)
    st.join("a")
    st.open(0.0)
    assert st.submit("a", 0, 0, np.int64(5), vec(1.0), 0.5).accepted
    st.join("b")
    verdict = st.submit("b", 0, 0, np.int64(500), vec(1.0), 0.6)
    assert verdict.reason is Reason.SAMPLES and "[1, 100]" in verdict.detail


def test_a_round_whose_members_all_left_after_submitting_closes_complete() -> None:
    st = opened("ab", round_timeout=10.0)
    st.submit("a", 0, 0, 1, vec(1.0), 0.1)
    st.submit("b", 0, 0, 1, vec(3.0), 0.2)
    st.leave("a")
    st.leave("b")
    assert st.due(0.3) is CloseReason.COMPLETE  # nothing more can come: no deadline wait
    np.testing.assert_array_equal(st.close(0.3).aggregate, vec(2.0))
    st.open(0.3)
    assert st.due(5.0) is None  # no members and nothing in: waits for a joiner


def test_a_member_whose_update_was_rejected_does_not_hold_the_round_open() -> None:
    """A member that stays connected but sends an update that is rejected (NaN, past
    the norm bound, the wrong dtype...) never had its part in, so every round waited for
    its deadline though the others' updates were in (an audit: 5 s a round, in both
    shapes). Its rejected update is its part now; a corrected one before the round
    closes still counts, and a rejected straggler for an earlier round is no part."""
    st = opened("abc", round_timeout=10.0)
    st.submit("a", 0, 0, 1, vec(1.0), 0.1)
    assert not st.submit("c", 0, 0, 1, vec(np.nan), 0.1).accepted
    assert st.due(0.2) is None  # b has not sent yet
    st.submit("b", 0, 0, 1, vec(3.0), 0.2)
    assert st.due(0.2) is CloseReason.COMPLETE
    out = st.close(0.2)
    assert out.applied and [p.client for p in out.participants] == ["a", "b"]
    assert out.rejected == {"nonfinite": 1}
    # Round 1: c corrects itself before the close, and its update counts.
    st.open(0.3)
    assert not st.submit("c", 1, 1, 1, vec(np.inf), 0.3).accepted
    assert st.submit("c", 1, 1, 1, vec(5.0), 0.35).accepted
    st.submit("a", 1, 1, 1, vec(1.0), 0.4)
    st.submit("b", 1, 1, 1, vec(3.0), 0.4)
    assert st.due(0.4) is CloseReason.COMPLETE
    np.testing.assert_array_equal(st.close(0.4).aggregate, vec(3.0))
    # Round 2: a rejected update sent for round 1 is not c's part of round 2.
    st.open(0.5)
    st.submit("a", 2, 2, 1, vec(1.0), 0.5)
    st.submit("b", 2, 2, 1, vec(1.0), 0.5)
    assert not st.submit("c", 1, 1, 1, vec(np.nan), 0.5).accepted
    assert st.due(0.6) is None
    assert st.due(10.5) is CloseReason.DEADLINE


def test_a_member_with_no_update_for_the_round_does_not_hold_it_open() -> None:
    """A member that says it has no update for the open round (``abstain``: nothing
    trained, or its update too stale to send) has its part in: the round closes
    ``complete`` once the others are in, not at its deadline. Its word counts for that
    round only, and an abstention is no update towards the quorum."""
    st = opened("abc", round_timeout=10.0)
    assert not st.abstain("c", 1)  # another round's word: not counted
    st.submit("a", 0, 0, 1, vec(1.0), 0.1)
    assert st.abstain("c", 0)
    assert st.due(0.2) is None  # b has not answered yet
    st.submit("b", 0, 0, 1, vec(3.0), 0.2)
    assert st.due(0.2) is CloseReason.COMPLETE
    out = st.close(0.2)
    assert out.applied and [p.client for p in out.participants] == ["a", "b"]
    assert not st.abstain("c", 0)  # round 0 has closed
    # Round 1: the word was for round 0 only.
    st.open(0.3)
    st.submit("a", 1, 1, 1, vec(1.0), 0.3)
    st.submit("b", 1, 1, 1, vec(1.0), 0.3)
    assert st.due(0.4) is None
    # An update after the word still counts.
    assert st.abstain("c", 1)
    assert st.submit("c", 1, 1, 1, vec(4.0), 0.5).accepted
    assert st.due(0.5) is CloseReason.COMPLETE
    np.testing.assert_array_equal(st.close(0.5).aggregate, vec(2.0))
    # Between rounds, a word for the round about to open counts when it opens.
    assert st.abstain("c", 2)
    st.open(0.6)
    st.submit("a", 2, 2, 1, vec(1.0), 0.6)
    st.submit("b", 2, 2, 1, vec(1.0), 0.6)
    assert st.due(0.6) is CloseReason.COMPLETE
    st.close(0.6)
    # A client with a late update carried in (not its part) that says it has none for
    # this round has its part in all the same (a reviewer: the carried update hid it).
    st.open(0.7)
    st.submit("a", 3, 3, 1, vec(1.0), 0.7)
    st.submit("b", 3, 3, 1, vec(1.0), 0.7)
    assert st.submit("c", 2, 2, 1, vec(1.0), 0.7).accepted  # late, for round 2
    assert st.due(0.7) is None
    assert st.abstain("c", 3)
    assert st.due(0.7) is CloseReason.COMPLETE
    st.close(0.7)
    # Abstentions are no updates: a round short of its quorum still waits.
    st = opened("abc", round_timeout=10.0, quorum=1.0)
    for c in "ab":
        st.abstain(c, 0)
    st.submit("c", 0, 0, 1, vec(1.0), 0.1)
    assert st.due(0.2) is None and st.due(10.0) is CloseReason.DEADLINE


def test_a_float_model_saturates_at_its_range_instead_of_becoming_inf(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Finite, valid updates could carry a float model past its dtype's range: the cast
    made inf, every update trained from that model was then rejected as not finite, and
    the run never moved again, without an error (an audit). Now the model saturates at
    the dtype's largest finite values, with a warning, as an integer model does."""
    f16 = np.full(2, 60000, np.float16)
    with caplog.at_level(logging.WARNING, logger="p2pdist.federated.aggregate"):
        got = apply_update(f16, np.array([6000.0, -6000.0], np.float16), 1.0)
    assert got.dtype == np.float16 and got.tolist() == [65504.0, 54016.0]  # float16 steps
    assert "1 values past what float16 holds" in caplog.text
    big = np.finfo(np.float64).max
    got64 = apply_update(np.array([big, -big]), np.array([big, -big]), 1.0)
    assert got64.tolist() == [big, -big]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="p2pdist.federated.aggregate"):
        assert apply_update(f16, np.ones(2, np.float16), 1.0).tolist() == [60000.0] * 2
    assert caplog.text == ""


def test_integer_models_are_rounded_to_nearest_not_truncated() -> None:
    i64 = np.dtype(np.int64)
    got = aggregate([np.array([1, -1, 3, 7]), np.array([2, -2, 0, 8])], [1, 1], "mean", 0.0, i64)
    assert got.tolist() == [2, -2, 2, 8]  # 1.5, -1.5, 1.5, 7.5 to nearest, ties to even
    got = aggregate([np.array([0]), np.array([1])], [1.0, 3.0], "mean", 0.0, i64)
    assert got.tolist() == [1]  # 0.75 (truncation gave 0: the majority never moved it)
    u8 = np.dtype(np.uint8)
    assert aggregate([np.array([250], u8)], [1.0], "median", 0.0, u8).tolist() == [250]
    assert apply_update(np.array([250], u8), np.array([9], u8), 1.0).tolist() == [255]


def test_a_scalar_model_stays_an_array_after_an_update() -> None:
    out = apply_update(np.array(1.5, np.float32), np.array(2.0, np.float32), 0.5)
    assert isinstance(out, np.ndarray) and out.shape == () and out.dtype == np.float32
    assert float(out) == 2.5


def test_a_big_endian_model_is_kept_little_endian_and_one_that_cannot_travel_is_refused() -> None:
    model = check_model(np.arange(3, dtype=">f4"))
    assert model.dtype == np.dtype("<f4") and model.tolist() == [0.0, 1.0, 2.0]
    st = FederatedRounds(model.shape, model.dtype, FederatedConfig())
    st.join("a")
    st.open(0.0)
    assert st.submit("a", 0, 0, 1, np.ones(3, np.float32), 0.1).accepted
    if np.dtype(np.longdouble).itemsize > 8:  # float128 where the platform has it
        with pytest.raises(UsageError, match="cannot travel"):
            check_model(np.zeros(3, np.longdouble))
    with pytest.raises(UsageError, match="at most 32 dimensions, got 33"):
        check_model(np.zeros((1,) * 33, np.float32))  # no model message could carry it
    # A delta may be negative: in uint8, 100 -> 99 would send 255 and saturate the model.
    with pytest.raises(UsageError, match=r"cannot be unsigned \(uint8\).*deltas"):
        check_model(np.full(2, 100, np.uint8))
    assert check_model(np.full(2, 100, np.int8)).dtype == np.int8


@pytest.mark.parametrize(("kind", "param"), [("exponential", 1e-200), ("polynomial", 700.0)])
def test_a_round_of_updates_all_too_stale_to_weigh_anything_still_averages(
    kind: str, param: float
) -> None:
    """d(2) underflows to 0 under these discounts: the floor keeps the weights positive,
    so the round is averaged by sample counts (the discount cancels out) instead of
    failing every close for good."""
    assert FederatedConfig(discount=kind, discount_param=param).staleness_factor(2) > 0
    st = rounds(max_staleness=2, discount=kind, discount_param=param)
    st.join("a")
    st.join("b")
    for t in range(2):  # rounds 0 and 1: nobody
        st.open(float(t))
        st.close(t + 0.5)
    st.open(2.0)
    assert st.submit("a", 2, 0, 1, vec(1.0), 2.1).accepted
    assert st.submit("b", 2, 0, 3, vec(3.0), 2.2).accepted
    out = st.close(3.0)
    assert out.applied and out.aggregate is not None
    np.testing.assert_array_equal(out.aggregate, vec(2.5))
    st.open(3.0)  # and the rounds go on
    assert st.round == 3


def test_huge_weights_do_not_overflow_the_mean() -> None:
    x = np.array([1e10, 1.0, 2.0])
    f64 = np.dtype(np.float64)
    np.testing.assert_array_equal(aggregate([x], [1e300], "mean", 0.0, f64), x)
    ys = [np.array([0.1, 3.0]), np.array([0.7, -1.0])]
    plain = (0.1 * 3 + 0.7 * 5) / 8, (3.0 * 3 - 1.0 * 5) / 8
    np.testing.assert_array_equal(aggregate(ys, [3.0, 5.0], "mean", 0.0, f64), plain)
    big = [3 * 2.0**1000, 5 * 2.0**1000]  # 3 and 5 times one power of two: the same bits
    np.testing.assert_array_equal(aggregate(ys, big, "mean", 0.0, f64), plain)
    with pytest.raises(UsageError, match="not all 0"):
        aggregate(ys, [0.0, 0.0], "mean", 0.0, f64)
    # A fresh weight beside one at the discount's floor: the formula's bits, as they are.
    zs = [np.array([0.0, 1.0]), np.array([1.2345678901234567e300, 1.0])]
    ws = [1000.0, 3.3 * MIN_DISCOUNT]
    formula = (zs[0] * ws[0] + zs[1] * ws[1]) / (ws[0] + ws[1])
    np.testing.assert_array_equal(aggregate(zs, ws, "mean", 0.0, f64), formula)
    # Every weight at the floor (every update stale under a steep discount): still the
    # sample-weighted mean, at full precision for small updates too (x * w used to land
    # in float64's subnormals, or at 0).
    for v in (1e-3, 1e-10, 1e-17):
        us = [np.array([v]), np.array([2 * v])]
        floor = [MIN_DISCOUNT, 3 * MIN_DISCOUNT]
        np.testing.assert_allclose(aggregate(us, floor, "mean", 0.0, f64), [1.75 * v], rtol=1e-15)


@pytest.mark.parametrize("rule", ["mean", "median", "trimmed_mean"])
def test_updates_near_float64s_limit_do_not_overflow_the_aggregate(rule: str) -> None:
    """Finite float64 updates whose sum passes 1.8e308 (two clients sending 1e308, or
    +-1e308): the mean of two equal updates came out saturated at 1.797e308, and of
    +-1e308 as NaN, which apply_update wrote into the model silently (an audit). Every
    rule gives the mean of what it keeps; elsewhere the same bits as before."""
    f64 = np.dtype(np.float64)
    same = [np.array([1e308, 1.0]), np.array([1e308, 3.0])]
    np.testing.assert_array_equal(aggregate(same, [1, 1], rule, 0.0, f64), [1e308, 2.0])
    apart = [np.array([1e308, 0.5]), np.array([-1e308, 0.25])]
    got = aggregate(apart, [2, 2], rule, 0.0, f64)
    np.testing.assert_array_equal(got, [0.0, 0.375])
    with np.errstate(all="raise"):  # and no warning on the way
        aggregate([np.array([1.5e308])] * 3, [1, 1, 1], rule, 0.0, f64)
    model = apply_update(np.array([1.0, 1.0]), got, 1.0)
    np.testing.assert_array_equal(model, [1.0, 1.375])


def test_a_sample_count_past_what_a_submission_can_carry_is_rejected() -> None:
    st = rounds()
    st.join("a")
    st.open(0.0)
    v = st.submit("a", 0, 0, 2**63, vec(1.0), 0.1)
    assert not v.accepted and v.reason is Reason.SAMPLES
    assert st.submit("a", 0, 0, 2**63 - 1, vec(1.0), 0.2).accepted
    out = st.close(1.0)
    np.testing.assert_array_equal(out.aggregate, vec(1.0))


def test_the_new_model_is_computed_in_float64_and_rounded_once() -> None:
    f16 = apply_update(np.array([-60000.0], np.float16), np.array([60000.0], np.float16), 2.0)
    assert f16.dtype == np.float16 and f16.tolist() == [60000.0]  # float16 arithmetic: inf
    rng = np.random.default_rng(3)
    model, update = rng.standard_normal((2, 10_000)).astype(np.float32)
    got = apply_update(model, update, 0.3)
    want = (model.astype(np.float64) + update.astype(np.float64) * 0.3).astype(np.float32)
    np.testing.assert_array_equal(got, want)


async def test_a_model_larger_than_one_frame_is_refused_when_its_averaging_is_made() -> None:
    """Each update travels in one frame. A bigger model used to be accepted, then every
    update (decentralised) or every client (coordinator) was dropped, said at INFO
    only, while the leader applied its own update alone and followers blamed it."""
    from p2pdist import Group, GroupConfig, TransportConfig
    from p2pdist.federated import Coordinator, GroupAveraging
    from p2pdist.wire.frames import FrameLimits

    small = TransportConfig(limits=FrameLimits(max_payload=1024))
    with pytest.raises(UsageError, match="1028 bytes, more than one frame carries"):
        Coordinator(np.zeros(257, np.float32), transport=small)
    Coordinator(np.zeros(256, np.float32), transport=small)  # exactly one frame: fine
    limit = 64 << 20  # the smallest frame limit a group takes
    cfg = GroupConfig(transport=TransportConfig(limits=FrameLimits(max_payload=limit)))
    async with Group.from_seed("fits-seed-0123456789", rank=0, world=1, config=cfg) as g:
        with pytest.raises(UsageError, match="raise the limit on every process"):
            GroupAveraging(g, np.zeros(limit // 4 + 1, np.float32))
        GroupAveraging(g, np.zeros(limit // 4, np.float32))  # the refused one left tag 0
