"""parse_offload_region and the real kube-apiserver (tests/envtest) with the CRD agree: every
manifest of test_crd_agreement.py's tables is created (dry run) in the real server, which must
accept and default exactly what parse_offload_region accepts, and refuse (422, naming the
field) what it refuses; every CEL rule of the CRD refuses one of them."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import kubernetes
import pytest
import yaml

from kvshm.api import GROUP, REGION_PLURAL, VERSION, SpecError, parse_offload_region
from tests.api.admission import REGION_SCHEMA, rules
from tests.api.test_crd_agreement import BAD, DEMO, GOOD, manifest_for, setting, spec_of
from tests.envtest.chart import ensure_namespace

Answer = dict[str, Any] | kubernetes.client.ApiException


def dry_run_create(client: kubernetes.client.ApiClient, manifest: dict[str, Any]) -> Answer:
    """What the server stores for manifest (created with dryRun=All: nothing is kept)."""
    metadata = manifest["metadata"]
    namespace = metadata.get("namespace", "default")
    ensure_namespace(client, namespace)
    try:
        stored: dict[str, Any] = kubernetes.client.CustomObjectsApi(
            client
        ).create_namespaced_custom_object(
            GROUP, VERSION, namespace, REGION_PLURAL, manifest, dry_run="All"
        )
    except kubernetes.client.ApiException as exc:
        return exc
    return stored


def server_spelling(field: str) -> str:
    """The table's field path as the API server writes it: a map key as `.key` (list
    indexes stay `[i]`), and the object itself (a rule at the root) as `<nil>`."""
    return re.sub(r"\[([^]0-9][^]]*)\]", r".\1", field) or "<nil>"


@pytest.mark.parametrize("case", GOOD, ids=list(GOOD))
def test_the_server_accepts_with_the_parsers_defaults(
    case: str, envtest_admin: kubernetes.client.ApiClient
) -> None:
    manifest = manifest_for(GOOD[case])
    stored = dry_run_create(envtest_admin, copy.deepcopy(manifest))
    assert isinstance(stored, dict), f"the API server refused {case}: {stored.body}"
    parsed = parse_offload_region(manifest)
    meta = stored["metadata"]
    server_fields = {"uid": meta["uid"], "generation": meta.get("generation", parsed.generation)}
    assert parse_offload_region(stored) == dataclasses.replace(parsed, **server_fields)
    stored_spec = dict(stored["spec"])
    assert stored_spec.pop("instanceId", stored["metadata"]["name"]) == parsed.instance_id
    placement = stored_spec.get("placement", {})
    if placement.get("nodeSelector") == {}:
        placement.pop("nodeSelector")
    if "placement" in stored_spec and not placement:
        stored_spec.pop("placement")
    assert stored_spec == spec_of(parsed)


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_the_server_refuses_what_the_parser_refuses(
    case: str, envtest_admin: kubernetes.client.ApiClient
) -> None:
    edits, api_field, parser_says = BAD[case]
    manifest = manifest_for(edits)
    refused = dry_run_create(envtest_admin, copy.deepcopy(manifest))
    assert isinstance(refused, kubernetes.client.ApiException), f"the server accepted {case}"
    assert refused.status == 422, refused.body
    status = yaml.safe_load(refused.body)
    fields = [cause.get("field", "") for cause in status["details"]["causes"]]
    api_field = server_spelling(api_field)
    prefixes = (api_field + ".", api_field + "[")
    named = [f for f in fields if f == api_field or f.startswith(prefixes)]
    assert named, (fields, status["message"])
    with pytest.raises(SpecError) as raised:
        parse_offload_region(manifest)
    assert parser_says in str(raised.value)


def test_the_demo_region_is_accepted(envtest_admin: kubernetes.client.ApiClient) -> None:
    manifest = yaml.safe_load(DEMO.read_text())
    stored = dry_run_create(envtest_admin, copy.deepcopy(manifest))
    assert isinstance(stored, dict), stored.body
    assert parse_offload_region(stored).layout == parse_offload_region(manifest).layout


def test_unknown_fields_are_refused_by_strict_validation_and_else_dropped(
    envtest_admin: kubernetes.client.ApiClient,
) -> None:
    """What docs/crds.md says: `kubectl apply` (strict by default) refuses an unknown field;
    a client that does not ask for strict validation gets it dropped, with a warning."""
    manifest = manifest_for([setting("spec.colour", "blue"), setting("spec.layout.x", 1)])
    custom = kubernetes.client.CustomObjectsApi(envtest_admin)
    with pytest.raises(kubernetes.client.ApiException) as refused:
        custom.create_namespaced_custom_object(
            GROUP, VERSION, "default", REGION_PLURAL, manifest,
            dry_run="All", field_validation="Strict",
        )  # fmt: skip
    assert refused.value.status == 400
    message = yaml.safe_load(refused.value.body)["message"]
    assert 'strict decoding error: unknown field "spec.colour"' in message
    assert 'unknown field "spec.layout.x"' in message
    response = custom.create_namespaced_custom_object_with_http_info(
        GROUP, VERSION, "default", REGION_PLURAL, manifest, dry_run="All"
    )
    stored, headers = response[0], response[2]
    assert "colour" not in stored["spec"] and "x" not in stored["spec"]["layout"]
    assert 'unknown field \\"spec.colour\\"' in headers.get("Warning", "")  # quoted in the header


def test_every_rule_of_the_crd_refuses_some_manifest_of_the_table(
    envtest_admin: kubernetes.client.ApiClient,
) -> None:
    """No CEL rule goes untested: each (but the update-only ones) fires for a BAD case."""
    fired: list[str] = []
    for edits, _, _ in BAD.values():
        refused = dry_run_create(envtest_admin, manifest_for(edits))
        assert isinstance(refused, kubernetes.client.ApiException)
        fired.append(yaml.safe_load(refused.body)["message"])
    for path, rule in rules(REGION_SCHEMA):
        if "oldSelf" in rule["rule"]:
            continue  # transition rules: test_crd_updates.py
        assert any(rule["message"] in message for message in fired), (path, rule["rule"])
