"""The bench statistics over token timestamps (pure, no deployment)."""

from __future__ import annotations

from elasticep_testkit.harness.load import RequestRecord
from elasticep_testkit.harness.timeline import max_gap_overlapping, max_wait_across, tokens_per_s


def test_interruption_counts_the_first_token_wait_of_requests_in_flight():
    """The event at t=10: request A streams on with 0.1 s gaps; request B was sent to the
    dying rank at 9.9 and got its first token at 12.0, resubmitted to a survivor."""
    a = RequestRecord(0, 9.0, [9.1 + 0.1 * i for i in range(40)], end=13.0)
    b = RequestRecord(1, 9.9, [12.0, 12.1, 12.2], end=12.2)
    later = RequestRecord(2, 10.5, [10.9, 11.0], end=11.0)  # sent after the event: prefill
    # gaps alone read 0.1 s (B's first wait is no gap): the headline read too low
    assert abs(max_gap_overlapping([a, b, later], 10.0, 11.0) - 0.1) < 1e-9
    assert abs(max_wait_across([a, b, later], 10.0, 11.0) - 2.1) < 1e-9
    # a request in flight that never got a token waited until it ended
    lost = RequestRecord(3, 9.5, [], end=14.0)
    assert abs(max_wait_across([a, lost], 10.0, 11.0) - 4.5) < 1e-9
    # a request that had its first token before the event is measured by its gaps only
    assert abs(max_wait_across([a], 10.0, 11.0) - 0.1) < 1e-9
    assert max_wait_across([], 10.0, 11.0) == 0.0


def test_tokens_per_s_counts_the_half_open_window():
    r = RequestRecord(0, 0.0, [0.5, 1.0, 1.5, 2.0], end=2.0)
    assert tokens_per_s([r], 1.0, 2.0) == 2.0
    assert tokens_per_s([r], 2.0, 2.0) is None
