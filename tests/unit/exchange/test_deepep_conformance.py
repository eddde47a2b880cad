"""Conformance with the real DeepEP wheel (``tokenspeed-deepep`` 2.1): every signature, default,
return arity and handle field that ``exchange.deepep`` and the fake (``testing.deepep_fake``) rely
on, and the Config buffer-size hints, read from the installed ``deep_ep`` without a GPU.

Needs a CUDA torch and the wheel; ``make deepep-conformance`` (scripts/deepep_conformance.sh)
builds such a venv outside the repository and runs this file. Skipped where ``deep_ep`` does not
import (``make test``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch


def _import_deep_ep():
    try:
        import deep_ep
    except Exception as exc:  # noqa: BLE001 - ImportError, or an assert of deep_ep's NCCL check
        pytest.skip(
            f"deep_ep does not import ({type(exc).__name__}: {exc}); run `make deepep-conformance`"
        )
    return deep_ep


pytestmark = pytest.mark.deepep

BUFFER_METHODS = [
    "__init__",
    "get_dispatch_layout",
    "dispatch",
    "combine",
    "internode_dispatch",
    "internode_combine",
    "get_dispatch_config",
    "get_combine_config",
    "set_num_sms",
    "destroy",
]
RETURN_ARITY = {
    "get_dispatch_layout": 5,
    "dispatch": 6,
    "internode_dispatch": 6,
    "combine": 3,
    "internode_combine": 3,
}


def _params(fn) -> list[tuple[str, object]]:
    """(name, default) of each parameter, ``self`` dropped (annotations are not compared)."""
    return [
        (p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"
    ]


def _method_ast(cls, name: str) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, name)))).body[0]


def _return_arities(fn_ast: ast.FunctionDef) -> set[int]:
    """Element counts of the tuples a function returns (returns of calls are delegations)."""
    out = set()
    for node in ast.walk(fn_ast):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            out.add(len(node.value.elts))
    return out


def test_top_level_names_the_backend_imports():
    deep_ep = _import_deep_ep()
    from megatron_railwave.exchange.deepep_api import load_deep_ep

    api = load_deep_ep()
    assert (api.Buffer, api.Config, api.EventOverlap) == (
        deep_ep.Buffer,
        deep_ep.Config,
        deep_ep.EventOverlap,
    )
    assert deep_ep.topk_idx_t == torch.int64  # the backend's topk_idx dtype
    assert deep_ep.__version__.startswith("2.1")


@pytest.mark.parametrize("name", BUFFER_METHODS)
def test_fake_buffer_signature_equals_deepep(name):
    deep_ep = _import_deep_ep()
    from megatron_railwave.testing.deepep_fake import fake_deep_ep

    assert _params(getattr(fake_deep_ep(8).Buffer, name)) == _params(getattr(deep_ep.Buffer, name))


def test_fake_event_overlap_signature_equals_deepep():
    deep_ep = _import_deep_ep()
    from megatron_railwave.testing.deepep_fake import FakeEventOverlap

    assert _params(FakeEventOverlap.__init__) == _params(deep_ep.EventOverlap.__init__)
    assert _params(FakeEventOverlap.current_stream_wait) == _params(
        deep_ep.EventOverlap.current_stream_wait
    )


@pytest.mark.parametrize("name", sorted(RETURN_ARITY))
def test_return_arities_of_deepep_and_the_fake(name):
    deep_ep = _import_deep_ep()
    from megatron_railwave.testing.deepep_fake import fake_deep_ep

    real = _return_arities(_method_ast(deep_ep.Buffer, name))
    fake = _return_arities(_method_ast(fake_deep_ep(8).Buffer, name))
    if name in (
        "dispatch",
        "combine",
    ):  # DeepEP's also return the intranode tuples, of the same arity
        assert real == {RETURN_ARITY[name]} and fake <= {RETURN_ARITY[name]}
    elif name == "get_dispatch_layout":
        assert real == fake == {5}
    else:
        assert real == fake == {RETURN_ARITY[name]}


def test_internode_handle_layout_equals_deepep():
    """The handle tuple DeepEP builds in internode_dispatch, the names its cached dispatch unpacks,
    and the positions its combine reads: the fake's INTERNODE_HANDLE_FIELDS in the same order."""
    deep_ep = _import_deep_ep()
    from megatron_railwave.testing.deepep_fake import INTERNODE_HANDLE_FIELDS

    fn = _method_ast(deep_ep.Buffer, "internode_dispatch")
    built = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign)
        and isinstance(n.targets[0], ast.Name)
        and n.targets[0].id == "handle"
    ]
    assert len(built) == 1
    assert tuple(e.id for e in built[0].value.elts) == INTERNODE_HANDLE_FIELDS
    unpacked = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id == "handle"
    ]
    assert [tuple(e.id for e in n.targets[0].elts) for n in unpacked] == [INTERNODE_HANDLE_FIELDS]
    combine = _method_ast(deep_ep.Buffer, "internode_combine")
    (read,) = [
        n
        for n in ast.walk(combine)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id == "handle"
    ]
    names = [e.id for e in read.targets[0].elts]
    # Position 0: the sender's is_token_in_rank; 6: the receiver's per-source prefix sum; 7: source
    # meta.
    assert len(names) == 10 and names[0] == "is_combined_token_in_rank"
    assert names[6] == "gbl_rank_prefix_sum" and names[7] == "src_meta"


def test_config_constructor_and_hints_equal_deepep():
    deep_ep = _import_deep_ep()
    from megatron_railwave.testing.deepep_fake import fake_deep_ep

    fake = fake_deep_ep(8)
    kwargs = dict(
        num_sms=24,
        num_max_nvl_chunked_send_tokens=6,
        num_max_nvl_chunked_recv_tokens=256,
        num_max_rdma_chunked_send_tokens=6,
        num_max_rdma_chunked_recv_tokens=100,
    )  # rdma recv rounds up
    pairs = [(deep_ep.Config(**kwargs), fake.Config(**kwargs)), (deep_ep.Config(), fake.Config())]
    for sms in (20, 24):
        deep_ep.Buffer.set_num_sms(sms)
        fake.Buffer.set_num_sms(sms)
        for ranks in (16, 24, 32, 48, 64, 96, 128, 144, 160):
            pairs.append(
                (deep_ep.Buffer.get_dispatch_config(ranks), fake.Buffer.get_dispatch_config(ranks))
            )
            pairs.append(
                (deep_ep.Buffer.get_combine_config(ranks), fake.Buffer.get_combine_config(ranks))
            )
    deep_ep.Buffer.set_num_sms(20)
    fake.Buffer.set_num_sms(20)
    for real, mine in pairs:
        for row_bytes in (4112, 7184, 8208, 14352):
            for ranks in (8, 16, 32, 160):
                assert real.get_nvl_buffer_size_hint(
                    row_bytes, ranks
                ) == mine.get_nvl_buffer_size_hint(row_bytes, ranks)
                assert real.get_rdma_buffer_size_hint(
                    row_bytes, ranks
                ) == mine.get_rdma_buffer_size_hint(row_bytes, ranks)
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks"):
        deep_ep.Buffer.get_dispatch_config(40)


def test_backend_calls_use_only_deepep_keywords():
    """Every keyword the backend passes to the Buffer exists in DeepEP's signature."""
    deep_ep = _import_deep_ep()
    import megatron_railwave.exchange.deepep as backend

    tree = ast.parse(inspect.getsource(backend))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Attribute)
        and n.func.value.attr == "buffer"
    ]
    used = {(c.func.attr, k.arg) for c in calls for k in c.keywords}
    assert {m for m, _ in used} >= {"dispatch", "combine"}
    for method, keyword in used:
        assert keyword in inspect.signature(getattr(deep_ep.Buffer, method)).parameters, (
            method,
            keyword,
        )
