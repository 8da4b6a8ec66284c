"""Placement rules: what the CRD schema cannot check, decided from Nodes and OffloadNodes."""

from __future__ import annotations

import dataclasses

from kvshm.api import HugePages, RootPages, parse_offload_region
from kvshm.operator.placement import PlacementReason, Verdict, place
from tests.operator.builders import agent, cluster, region


def test_named_nodes_that_exist_and_fit_are_accepted() -> None:
    result = place(region(node_names=["b", "a"]), cluster(["a", "b", "c"]))
    assert result.verdict is Verdict.ACCEPTED
    assert result.targets == ("a", "b")


def test_a_node_name_that_is_not_a_node_is_rejected_with_the_name() -> None:
    result = place(region(node_names=["a", "ghost"]), cluster(["a"]))
    assert result.verdict is Verdict.REJECTED
    assert result.reason is PlacementReason.UNKNOWN_NODE
    assert "ghost" in result.message and "kubectl get nodes" in result.message
    assert result.targets == ("a",)  # the named node that exists still counts


def test_a_selector_that_matches_no_node_is_rejected() -> None:
    nodes = {"a": {"gpu": "h100"}, "b": {"gpu": "a100"}}
    result = place(region(selector={"gpu": "b200"}), cluster(nodes))
    assert result.verdict is Verdict.REJECTED
    assert result.reason is PlacementReason.NO_MATCHING_NODE
    assert "b200" in result.message


def test_selector_and_names_both_apply() -> None:
    nodes = {"a": {"gpu": "h100"}, "b": {"gpu": "h100"}, "c": {"gpu": "a100"}}
    result = place(region(node_names=["b", "c"], selector={"gpu": "h100"}), cluster(nodes))
    assert result.targets == ("b",)


def test_no_placement_means_every_node_with_an_agent() -> None:
    view = cluster(["a", "b", "c"], [agent("a"), agent("c")])
    assert place(region(), view).targets == ("a", "c")


def test_no_placement_and_no_agents_waits() -> None:
    result = place(region(), cluster(["a"], []))
    assert result.verdict is Verdict.WAITING
    assert result.reason is PlacementReason.WAITING_FOR_AGENTS


def test_a_region_larger_than_every_matching_root_is_rejected_with_both_sizes() -> None:
    view = cluster(["a", "b"], [agent("a", capacity_gib=8), agent("b", capacity_gib=16)])
    result = place(region(size_gib=32), view)
    assert result.verdict is Verdict.REJECTED
    assert result.reason is PlacementReason.INSUFFICIENT_CAPACITY
    assert str(32 * 2**30) in result.message and str(16 * 2**30) in result.message


def test_one_matching_node_large_enough_is_enough() -> None:
    view = cluster(["a", "b"], [agent("a", capacity_gib=8), agent("b", capacity_gib=64)])
    assert place(region(size_gib=32), view).verdict is Verdict.ACCEPTED


def test_capacity_of_nodes_outside_the_placement_does_not_count() -> None:
    view = cluster(["a", "b"], [agent("a", capacity_gib=8), agent("b", capacity_gib=64)])
    result = place(region(node_names=["a"], size_gib=32), view)
    assert result.verdict is Verdict.REJECTED


def test_matching_node_without_agent_waits_instead_of_rejecting() -> None:
    view = cluster(["a", "b"], [agent("a", capacity_gib=8)])
    result = place(region(node_names=["a", "b"], size_gib=32), view)
    assert result.verdict is Verdict.WAITING
    assert "b" in result.message and "OffloadNode" in result.message


def test_an_agent_that_has_not_measured_its_root_yet_waits() -> None:
    view = cluster(["a"], [agent("a", capacity_gib=None)])
    result = place(region(size_gib=32), view)
    assert result.verdict is Verdict.WAITING
    assert "not measured" in result.message


def test_a_node_whose_root_rounds_file_tails_up_needs_room_for_the_rounding() -> None:
    """32 files of 1057 MiB: a root that takes a whole huge page for each file's last partial
    one holds 31 MiB more than the region's size; its agent says so in status.pages."""
    manifest = {
        "metadata": {"name": "odd", "namespace": "team"},
        "spec": {"layout": {"numBlocks": 33 * 1024 + 1, "cpuPageSize": 2**20}},
    }
    odd = parse_offload_region(manifest)
    exact = dataclasses.replace(
        agent("a").status, capacity_bytes=odd.size_bytes, free_bytes=odd.size_bytes
    )
    for pages, verdict in (
        (RootPages(2**21, HugePages.WITHIN_SIZE), Verdict.ACCEPTED),
        (RootPages(2**21, HugePages.ALWAYS, rounds_up=True), Verdict.REJECTED),
    ):
        node = dataclasses.replace(agent("a"), status=dataclasses.replace(exact, pages=pages))
        result = place(odd, cluster(["a"], [node]))
        assert result.verdict is verdict, result.message
    assert str(odd.size_bytes + 31 * 2**20) in result.message
