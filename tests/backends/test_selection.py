"""get_backend: names, "auto" by device type, instances passed through, clear errors."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from cpkv.backends import BACKEND_NAMES, ReferenceBackend, get_backend, resolve_backend_name, reference
from cpkv.backends.base import AttentionBackend
from cpkv.backends.cuda import CUDABackend

PRIMITIVES = ("varlen_attention", "range_attention", "sparse_attention", "selected_probs", "indexer_topk")


def test_names() -> None:
    assert BACKEND_NAMES == ("reference", "cuda", "npu", "auto")
    assert isinstance(get_backend("reference"), ReferenceBackend)
    assert isinstance(get_backend("cuda"), CUDABackend)  # creating it needs no GPU; calls on CPU tensors fall back
    assert ReferenceBackend is reference.ReferenceBackend  # the reference package's backend


@pytest.mark.parametrize("name", ["reference", "cuda"])
def test_created_backends_implement_every_primitive(name: str) -> None:
    backend = get_backend(name)
    for primitive in PRIMITIVES:
        want = [(p.name, p.kind) for p in inspect.signature(getattr(AttentionBackend, primitive)).parameters.values()][1:]
        got = [(p.name, p.kind) for p in inspect.signature(getattr(backend, primitive)).parameters.values()]
        assert got == want, f"{name}.{primitive}"


@pytest.mark.parametrize(
    ("device", "expected"),
    [(None, "reference"), ("cpu", "reference"), (torch.device("cpu"), "reference"), ("cuda", "cuda"),
     ("cuda:1", "cuda"), ("npu", "npu"), (torch.device("meta"), "reference")],
)
def test_auto_resolves_by_device_type(device: torch.device | str | None, expected: str) -> None:
    assert resolve_backend_name("auto", device) == expected


def test_auto_without_device_is_reference_and_explicit_names_override() -> None:
    assert get_backend("auto").name == "reference"
    assert get_backend("auto", "cpu").name == "reference"
    assert get_backend("reference", "cuda").name == "reference"
    assert resolve_backend_name("npu", "cpu") == "npu"


def test_instances_pass_through() -> None:
    backend = ReferenceBackend(block_size=7)
    assert get_backend(backend) is backend
    assert get_backend(backend, "cuda") is backend


def test_errors() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        get_backend("flash")
    with pytest.raises(TypeError, match="device must be"):
        get_backend("auto", 3)  # type: ignore[arg-type]
    if "torch_npu" not in sys.modules:
        with pytest.raises(RuntimeError, match="torch_npu"):
            get_backend("npu")
        with pytest.raises(RuntimeError, match="torch_npu"):
            get_backend("auto", "npu")
