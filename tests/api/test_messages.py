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


def test_readable_bytes_says_a_size_as_people_read_it() -> None:
    from kvshm.api.messages import readable_bytes

    cases = {
        0: "0B",
        1023: "1023B",
        65536: "64Ki",
        33554432: "32Mi",
        2**30: "1Gi",
        8589934592: "8Gi",
        68718428160: "64.0Gi",  # 64 GiB and 40 KiB: not whole, one decimal
        2684354560: "2.5Gi",
        2**41: "2Ti",
    }
    assert {count: readable_bytes(count) for count in cases} == cases
