"""Status messages: lists summarised, text cut to the CRD's bound."""

from __future__ import annotations

from kvshm.api.messages import MAX_STATUS_MESSAGE, bounded, summarize


def test_short_lists_are_named_and_long_ones_counted() -> None:
    assert summarize([]) == ""
    assert summarize(["a"]) == "a"
    assert summarize(["a", "b"]) == "a and b"
    assert summarize(["a", "b", "c"]) == "a, b and c"
    many = [f"n{i}" for i in range(30)]
    assert summarize(many) == "30 nodes: n0, n1, n2 and 27 more"
    assert summarize(many, "names") == "30 names: n0, n1, n2 and 27 more"


def test_text_is_cut_to_the_bound_and_says_so() -> None:
    assert bounded("short") == "short"
    exact = "x" * MAX_STATUS_MESSAGE
    assert bounded(exact) == exact
    cut = bounded("y" * (MAX_STATUS_MESSAGE + 1))
    assert len(cut) == MAX_STATUS_MESSAGE and cut.endswith("…")
