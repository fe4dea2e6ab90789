"""The documentation stays true: the API reference is current, links resolve, quoted errors are real."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cpkv import (
    AttentionSpec,
    actual_seq_len_to_cu_seqlens,
    attention_forward,
    check_zigzag_tnd_lengths,
    compute_prefix_kv_cu_seqlens,
    contiguous_shard_range,
    global_num_seqs,
    plan_attention,
    rearrange_prefix_kv,
    shard_zigzag,
    validate_cu_seqlens,
)
from cpkv.backends import ReferenceBackend
from cpkv.v4 import V4Attention, V4Config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_api_reference_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_api_docs.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + "\nregenerate with: python scripts/gen_api_docs.py"


def test_api_reference_documents_every_public_name() -> None:
    import cpkv

    text = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [name for name in cpkv.__all__ if f"### `cpkv.{name}`" not in text]
    assert not missing


def _public_modules() -> list[str]:
    """cpkv's modules with no ``_`` in their dotted name that assign ``__all__`` (read from the source)."""
    found = []
    for path in sorted((ROOT / "cpkv").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        tree = ast.parse(path.read_text(encoding="utf-8"))
        declares = any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets) for n in tree.body)
        if declares and not any(part.startswith("_") for part in parts):
            found.append(".".join(parts))
    return found


def _resolve(qualname: str) -> object:
    """The object a documented ``package.module.name`` heading names (its longest importable module prefix)."""
    parts = qualname.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(qualname)


def test_api_reference_documents_every_public_module_name() -> None:
    """Every name in a public module's ``__all__`` has a section, under that module or wherever the same object is."""
    headings = re.findall(r"^### `([\w.]+)`", (DOCS / "api.md").read_text(encoding="utf-8"), flags=re.M)
    modules = _public_modules()
    assert {"cpkv.backends.cuda", "cpkv.backends.npu", "cpkv.integrations.transformers"} <= set(modules)
    missing = []
    for name in modules:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if not any(h.rsplit(".", 1)[-1] == attr and _resolve(h) is obj for h in headings):
                missing.append(f"{name}.{attr}")
    assert not missing, "regenerate with: python scripts/gen_api_docs.py"


def test_public_modules_import_without_optional_dependencies() -> None:
    """Importing every public module (what the API reference does) loads neither torch_npu, triton nor transformers."""
    code = (
        "import importlib, sys\n"
        f"for name in {_public_modules()!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch_npu', 'triton', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "page", ["design.md", "conventions.md", "semantics.md", "troubleshooting.md", "api.md", "backends.md", "guide.md",
             "integrations.md", "benchmarks.md", "mindspeed.md", "../README.md", "../examples/README.md"]
)
def test_relative_links_resolve(page: str) -> None:
    path = (DOCS / page).resolve()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8"))
    broken = [link for link in links if "://" not in link and not (path.parent / link).exists()]
    assert not broken


CU = torch.tensor([0, 5, 12, 12, 24, 27, 32])  # the docs' running example
SPEC = AttentionSpec(d_v=8, window=16)


class _NamedNPU(ReferenceBackend):
    """A backend that reports itself as the NPU one (the ring check looks at the name only)."""

    name = "npu"


def _one_rank(call: Callable[[int], object]) -> Callable[[], object]:
    """Run ``call(T)`` on a one-rank gloo group (for checks that read the group size), then tear it down."""

    def run() -> object:
        if dist.is_initialized():
            return call(int(CU[-1]))
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            return call(int(CU[-1]))
        finally:
            dist.destroy_process_group()

    return run


def _forward(t: int, plan: object, spec: AttentionSpec = SPEC, group: object = None, **kwargs: object) -> object:
    return attention_forward(torch.zeros(t, 2, 8), torch.zeros(t, 8), plan, group, spec=spec, **kwargs)  # type: ignore[arg-type]


def _layer_call(
    plan: object, hidden_width: int = 64, compressor: object = None, indexer: object = None, features_width: int | None = None,
) -> object:
    """An INDEXER layer call of the docs' running example with the V4 layer's modules."""
    layer = V4Attention(V4Config(compress_ratio=4, window=16))
    x = torch.randn(int(CU[-1]), 64)
    q, kv = layer.project(x, torch.zeros(int(CU[-1]), dtype=torch.int64))
    return attention_forward(
        q, kv, plan, None, spec=AttentionSpec(d_v=24, window=16, compress_ratio=4), hidden=x[:, :hidden_width],  # type: ignore[arg-type]
        compressor=compressor or layer.compressor, indexer=indexer or layer.indexer,  # type: ignore[arg-type]
        index_features=None if features_width is None else x[:, :features_width],
    )


class _HalfWidth:
    """A compressor that returns entries half as wide as kv."""

    def __init__(self) -> None:
        self.inner = V4Attention(V4Config(compress_ratio=4, window=16)).compressor
        assert self.inner is not None
        self.ratio, self.prev_blocks, self.input_dim = self.inner.ratio, self.inner.prev_blocks, self.inner.input_dim

    def __call__(self, x: torch.Tensor, plan: object) -> torch.Tensor:
        assert self.inner is not None
        entries = self.inner(x, plan)  # type: ignore[arg-type]
        assert entries is not None
        return entries[:, :16]


ERRORS: list[tuple[type[Exception], Callable[[], object]]] = [
    (ValueError, lambda: contiguous_shard_range(17, 2, 0)),
    (ValueError, lambda: shard_zigzag(torch.zeros(1, 12, 1, 1), 4, 0)),
    (ValueError, lambda: plan_attention(torch.tensor([0, 12]), 4, 0, layout="zigzag")),
    (ValueError, lambda: validate_cu_seqlens(torch.tensor([5, 12, 16]))),
    (ValueError, lambda: actual_seq_len_to_cu_seqlens([0, 5, 12])),
    (TypeError, lambda: validate_cu_seqlens(torch.tensor([0.0, 5.0, 12.0]))),
    (ValueError, lambda: validate_cu_seqlens(torch.tensor([0, 12, 5]))),
    (ValueError, lambda: validate_cu_seqlens(torch.tensor([0, 5, 12]), num_tokens=16)),
    (ValueError, lambda: compute_prefix_kv_cu_seqlens(torch.tensor([0, 5, 12, 16]), 16, 8)),
    (ValueError, lambda: rearrange_prefix_kv(torch.zeros(16, 1), compute_prefix_kv_cu_seqlens(torch.tensor([0, 5, 12, 17]), 8, 8))),
    (ValueError, lambda: plan_attention(torch.tensor([0, 8, 16]), 2, 0).segments.compressed_for(4)),
    (ValueError, lambda: AttentionSpec(d_v=8, compress_ratio=4, window=None).validate()),
    (ValueError, lambda: check_zigzag_tnd_lengths(CU, 4)),
    (ValueError, lambda: plan_attention(CU, 4, 0, ring_degree=2)),
    (ValueError, lambda: plan_attention(torch.tensor([0, 4, 10]), 4, 0)),
    (ValueError, lambda: plan_attention(CU, 4, 0, layout="bsnd")),  # type: ignore[arg-type]
    (TypeError, lambda: _forward(8, CU)),
    (ValueError, _one_rank(lambda t: _forward(t, plan_attention(CU, 1, 0, exchange="need")))),
    (ValueError, _one_rank(lambda t: _forward(t, plan_attention(CU, 2, 0)))),
    (ValueError, _one_rank(lambda t: _forward(t, plan_attention(CU, 1, 0, exchange="need", windows=[16], ring_degree=2), backend=_NamedNPU()))),
    (ValueError, _one_rank(lambda t: _forward(t, plan_attention(CU, 1, 0, compress_ratios=[4]), spec=AttentionSpec(d_v=8, compress_ratio=8, window=16)))),
    (ValueError, _one_rank(lambda t: plan_attention(CU, 2, 1, group=dist.group.WORLD))),
    (ValueError, _one_rank(lambda t: _layer_call(plan_attention(CU, 1, 0, exchange="need", windows=[16], compress_ratios=[4], prev_blocks={4: 0})))),
    (ValueError, _one_rank(lambda t: _layer_call(plan_attention(CU, 1, 0, compress_ratios=[4]), hidden_width=32))),
    (TypeError, _one_rank(lambda t: _layer_call(plan_attention(CU, 1, 0, compress_ratios=[4]), compressor=lambda x, p: None))),
    (TypeError, _one_rank(lambda t: _forward(t, plan_attention(CU, 1, 0), group="cp"))),
    (ValueError, _one_rank(lambda t: _layer_call(plan_attention(CU, 1, 0, compress_ratios=[4]), compressor=_HalfWidth()))),
    (TypeError, _one_rank(lambda t: _layer_call(plan_attention(CU, 1, 0, compress_ratios=[4]),
                                                indexer=V4Attention(V4Config(compress_ratio=4)).compressor))),
    (ValueError, _one_rank(lambda t: _layer_call(plan_attention(CU, 1, 0, compress_ratios=[4]), features_width=32))),
    (TypeError, lambda: global_num_seqs(torch.tensor(True), None)),
]


@pytest.mark.parametrize("expected, call", ERRORS)
def test_troubleshooting_quotes_the_real_messages(expected: type[Exception], call: Callable[[], object]) -> None:
    with pytest.raises(expected) as info:
        call()
    quoted = f"{expected.__name__}: {info.value}"
    assert quoted in (DOCS / "troubleshooting.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("page", ["design.md", "conventions.md", "troubleshooting.md", "../examples/README.md"])
def test_no_coming_placeholders_left(page: str) -> None:
    """Features described as "coming" have landed: the pages describe them instead."""
    assert "(coming" not in (DOCS / page).read_text(encoding="utf-8")


NUMBERS = {5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}


def _read(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


def test_primitive_counts_match_the_backend_protocol() -> None:
    """Every page that counts the backend's primitives counts the Protocol's methods, and its tables list each."""
    from cpkv.backends.base import AttentionBackend

    tree = ast.parse(_read("cpkv/backends/base.py"))
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == AttentionBackend.__name__)
    methods = [f.name for f in protocol.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    word = NUMBERS[len(methods)]
    for page in ("docs/guide.md", "docs/backends.md", "docs/design.md", "docs/semantics.md"):
        text = _read(page)
        counts = re.findall(r"\b(\w+|\d+) primitives\b", text)
        counts = [c for c in counts if c.isdigit() or c in NUMBERS.values()]  # not "dense primitives"
        assert counts and all(c in (word, str(len(methods))) for c in counts), (page, counts)
    for page in ("docs/backends.md", "docs/semantics.md"):
        table = _read(page).split("| primitive |", 1)[1].split("\n\n", 1)[0]
        listed = re.findall(r"^\| `(\w+)", table, flags=re.M)
        assert listed == methods, (page, listed)


def _spawned_world(test_file: str, fn: str) -> int:
    match = re.search(rf"spawn\({fn}, (\d+)", _read(test_file))
    assert match, (test_file, fn)
    return int(match.group(1))


def test_coverage_claims_match_the_tests() -> None:
    """The cp sizes integrations.md and semantics.md claim for the Hugging Face tests are the ones the tests spawn."""
    lm, padded = (_spawned_world("tests/integrations/test_transformers_lm.py", f) for f in ("_all_cp_sizes", "_padding_and_ranks"))
    attention = _spawned_world("tests/integrations/test_transformers.py", "_all_cp_sizes")
    readme, semantics = _read("docs/integrations.md"), _read("docs/semantics.md")
    assert f"tested in float64 at cp 1-{lm}, both exchanges, every\nlayout" in readme
    assert f"zigzag with padding and the indexer loss at cp 1-{padded}" in readme
    assert f"That holds at cp 1-{lm} for every layout" in semantics
    assert f"and at cp 1-{padded} for\npadded zigzag" in semantics
    assert f"parameter gradients summed over ranks at cp 1-{attention}, for\nevery layer type and every layout" in semantics


def test_spec_window_default_is_the_documented_one() -> None:
    import dataclasses

    default = {f.name: f.default for f in dataclasses.fields(AttentionSpec)}["window"]
    assert default is None and "`AttentionSpec.window`, whose default is `None`: dense causal" in _read("docs/semantics.md")


def test_the_version_is_the_newest_changelog_release() -> None:
    """pyproject.toml, ``cpkv.__version__`` and the CHANGELOG's newest dated release name one version."""
    import tomllib

    import cpkv

    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert version == cpkv.__version__ == releases[0], (version, cpkv.__version__, releases[:2])
