"""No kvshm module draws a stream from torch's pool (kvshm.transfer.cuda.streams says why): every
call of torch.cuda.Stream(...) in kvshm's sources would be one. Read from the source, so that it
holds in CI, where no GPU builds a handler."""

from __future__ import annotations

import ast

from tests.source_roots import REPO, SOURCE_ROOTS

KVSHM_ROOTS = [root / "kvshm" for root in SOURCE_ROOTS]


def pooled_stream_calls(source: str) -> list[int]:
    """Lines calling <anything>.cuda.Stream(...) or a bare Stream(...) imported from
    torch.cuda."""
    tree = ast.parse(source)
    from_torch = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ("torch.cuda", "torch.cuda.streams")
        for alias in node.names
        if alias.name == "Stream"
    }
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "Stream":
            if isinstance(func.value, ast.Attribute) and func.value.attr == "cuda":
                lines.append(node.lineno)
        elif isinstance(func, ast.Name) and func.id in from_torch:
            lines.append(node.lineno)
    return lines


def test_the_check_finds_each_way_of_drawing_a_pooled_stream() -> None:
    source = (
        "import torch\nfrom torch.cuda import Stream as S\n"
        "a = torch.cuda.Stream()\nb = S(priority=-1)\nc = torch.cuda.ExternalStream(1)\n"
    )
    assert pooled_stream_calls(source) == [3, 4]


def test_no_kvshm_module_draws_from_torchs_stream_pool() -> None:
    modules = sorted(path for root in KVSHM_ROOTS for path in root.rglob("*.py"))
    assert len(modules) > 20  # the tree was found
    found = {
        str(path.relative_to(REPO)): lines
        for path in modules
        if (lines := pooled_stream_calls(path.read_text()))
    }
    assert found == {}, f"use kvshm.transfer.cuda.streams.own_stream instead: {found}"
