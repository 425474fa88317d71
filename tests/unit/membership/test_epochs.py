"""Stability, hysteresis and the epoch rules of the pure tracker."""

from ravnest_p2p.membership import Action, EpochTracker, Phase, Timing

T = Timing(stable_rounds=3, hysteresis_s=2.0, join_delay_s=5.0, grace_s=4.0, agreement_timeout_s=10.0)
ABC = frozenset("abc")


def settle(tracker: EpochTracker, digest: str, live: frozenset[str], start: float) -> float:
    """Tick once per second until the tracker proposes; return the time it did."""
    now = start
    while tracker.tick(now, digest, live) != Action.PROPOSE:
        now += 1.0
        assert now < start + 60
    return now


def active_tracker() -> tuple[EpochTracker, float]:
    tracker = EpochTracker(T)
    now = settle(tracker, "d1", ABC, 0.0)
    tracker.proposed(now, ABC)
    tracker.activated()
    return tracker, now


def test_proposes_only_after_stable_rounds_and_hysteresis():
    tracker = EpochTracker(T)
    assert tracker.tick(0.0, "d1", ABC) == Action.NONE
    assert tracker.tick(0.1, "d1", ABC) == Action.NONE
    assert tracker.tick(0.2, "d1", ABC) == Action.NONE
    assert tracker.tick(0.3, "d1", ABC) == Action.NONE  # 3 stable rounds but only 0.3 s: hysteresis
    assert tracker.tick(2.0, "d1", ABC) == Action.PROPOSE
    assert tracker.tick(2.1, "d2", ABC) == Action.NONE  # a change resets stability
    assert tracker.stable_count == 0


def test_view_change_while_proposed_goes_back_to_forming_same_epoch():
    tracker = EpochTracker(T)
    now = settle(tracker, "d1", ABC, 0.0)
    tracker.proposed(now, ABC)
    assert tracker.tick(now + 1, "d2", ABC | {"d"}) == Action.NONE
    assert tracker.phase == Phase.FORMING
    assert tracker.epoch == 0


def test_blip_shorter_than_grace_does_not_open_an_epoch():
    tracker, now = active_tracker()
    for t in range(3):  # member "c" missing for 3 s < grace 4 s
        assert tracker.tick(now + 1 + t, "d-", frozenset("ab")) == Action.NONE
    assert tracker.tick(now + 4, "d1", ABC) == Action.NONE
    for t in range(10):
        assert tracker.tick(now + 5 + t, "d1", ABC) == Action.NONE
    assert tracker.epoch == 0
    assert tracker.phase == Phase.ACTIVE


def test_departure_past_grace_opens_next_epoch():
    tracker, now = active_tracker()
    actions = [tracker.tick(now + 1 + t, "d-", frozenset("ab")) for t in range(5)]
    assert actions[:4] == [Action.NONE] * 4
    assert actions[4] == Action.NEW_EPOCH
    assert (tracker.epoch, tracker.phase) == (1, Phase.FORMING)


def test_join_waits_for_join_delay_and_leaving_joiner_is_forgotten():
    tracker, now = active_tracker()
    abcd = ABC | {"d"}
    assert tracker.tick(now + 1, "d+", abcd) == Action.NONE
    assert tracker.tick(now + 3, "d1", ABC) == Action.NONE  # the joiner went away again
    assert tracker.tick(now + 4, "d+", abcd) == Action.NONE  # and came back: its clock restarts
    assert tracker.tick(now + 8, "d+", abcd) == Action.NONE
    assert tracker.tick(now + 9, "d+", abcd) == Action.NEW_EPOCH
    assert tracker.epoch == 1


def test_higher_epoch_heard_moves_us_lower_does_not():
    tracker, _ = active_tracker()
    assert tracker.open_epoch(5)
    assert (tracker.epoch, tracker.phase) == (5, Phase.FORMING)
    assert not tracker.open_epoch(5)
    assert not tracker.open_epoch(3)
    assert tracker.epoch == 5


def test_proposal_times_out():
    tracker = EpochTracker(T)
    now = settle(tracker, "d1", ABC, 0.0)
    tracker.proposed(now, ABC)
    assert tracker.tick(now + 5, "d1", ABC) == Action.NONE
    assert tracker.tick(now + 10, "d1", ABC) == Action.TIMEOUT
    tracker.retry(now + 10)
    assert tracker.phase == Phase.FORMING
