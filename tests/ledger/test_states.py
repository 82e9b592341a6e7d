import pytest

from rlsys.types import (
    ALLOWED_TRANSITIONS,
    TERMINAL_CLASS,
    TERMINAL_STATES,
    RolloutState,
    TerminalClass,
    transition_allowed,
)

pytestmark = pytest.mark.unit


def test_every_terminal_state_has_exactly_one_class():
    assert set(TERMINAL_CLASS) == set(TERMINAL_STATES)
    assert TERMINAL_CLASS[RolloutState.TRAINED] is TerminalClass.CONSUMED
    assert TERMINAL_CLASS[RolloutState.FILTERED_STALE] is TerminalClass.DISCARDED
    assert TERMINAL_CLASS[RolloutState.CANCELLED] is TerminalClass.DROPPED


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES))
def test_no_transition_leaves_a_terminal_state(state):
    assert ALLOWED_TRANSITIONS[state] == frozenset()
    assert not any(transition_allowed(state, to) for to in RolloutState)


def test_trained_only_from_buffered():
    sources = [s for s in RolloutState if transition_allowed(s, RolloutState.TRAINED)]
    assert sources == [RolloutState.BUFFERED]


def test_failures_and_cancel_allowed_from_every_live_state():
    live = [s for s in RolloutState if s not in TERMINAL_STATES]
    for s in live:
        assert transition_allowed(s, RolloutState.FAILED_WORKER_LOST)
        assert transition_allowed(s, RolloutState.CANCELLED)


def test_lifecycle_steps_fire_and_skips_do_not():
    assert transition_allowed("planned", "admitted")
    assert transition_allowed("running", "scored")
    assert not transition_allowed("planned", "running")
    assert not transition_allowed("running", "buffered")
    assert not transition_allowed("planned", "filtered_stale")
