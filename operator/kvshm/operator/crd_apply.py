"""`kvshm-apply-crds DIR`: server-side apply of kvshm's CRDs, the chart's pre-upgrade hook.

Helm installs a chart's crds/ once and never upgrades them; the hook Job runs this command in
kvshm's own image (no kubectl image to pull or keep within a version of the cluster) on the
CRDs its ConfigMap mounts. Only CustomResourceDefinitions of the kvshm.dev group are applied:
anything else in DIR is refused before any is sent. The field manager is kvshm-crd-upgrade,
conflicts forced, as `kubectl apply --server-side --force-conflicts` would.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvshm.api import GROUP
from kvshm.operator.kube import client_configuration

FIELD_MANAGER = "kvshm-crd-upgrade"
MAX_FILE_BYTES = 4 * 1024 * 1024
KIND_PREFIX = "customresourcedefinition.apiextensions.k8s.io"


class CrdFileError(ValueError):
    """A file in the directory is not one of kvshm's CRDs; the message names it and why."""


def load_crds(directory: Path) -> list[dict[str, Any]]:
    """Every CRD in the directory's *.yaml files, checked to be kvshm.dev's own."""
    files = sorted(p for p in directory.glob("*.yaml") if p.is_file())
    if not files:
        raise CrdFileError(f"{directory} holds no *.yaml file: nothing to apply")
    crds = []
    for path in files:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise CrdFileError(f"{path}: larger than {MAX_FILE_BYTES} bytes, not a CRD of kvshm")
        try:
            documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
        except yaml.YAMLError as exc:
            raise CrdFileError(f"{path}: not YAML ({exc})") from exc
        for document in documents:
            kind = document.get("kind") if isinstance(document, dict) else None
            group = (document.get("spec") or {}).get("group") if kind else None
            if kind != "CustomResourceDefinition" or group != GROUP:
                raise CrdFileError(
                    f"{path}: holds a {kind or type(document).__name__}"
                    f"{f' of group {group}' if group else ''}; only {GROUP} CRDs are applied"
                )
            crds.append(document)
    return crds


def apply(crds: Sequence[dict[str, Any]]) -> list[str]:
    """Server-side apply each CRD; returns what was applied, one line each as kubectl says it."""
    import kubernetes

    with kubernetes.client.ApiClient(client_configuration()) as client:
        extensions = kubernetes.client.ApiextensionsV1Api(client)
        applied = []
        for crd in crds:
            name = crd["metadata"]["name"]
            extensions.patch_custom_resource_definition(
                name,
                crd,
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type="application/apply-patch+yaml",
            )
            applied.append(f"{KIND_PREFIX}/{name} serverside-applied")
    return applied


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvshm-apply-crds",
        description="Server-side apply kvshm's CustomResourceDefinitions from DIR/*.yaml "
        f"(field manager {FIELD_MANAGER}, conflicts forced); the chart's pre-upgrade hook.",
    )
    parser.add_argument("directory", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    try:
        crds = load_crds(args.directory)
    except (CrdFileError, OSError) as exc:
        print(f"kvshm-apply-crds: {exc}", file=sys.stderr)
        return 2
    try:
        for line in apply(crds):
            print(line, flush=True)
    except Exception as exc:  # the API's refusal or an unreachable server: say which, fail the Job
        print(f"kvshm-apply-crds: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
