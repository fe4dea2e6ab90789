"""Generate docs/api.md from the docstrings of cpkv's public API.

Usage::

    python scripts/gen_api_docs.py            # (re)write docs/api.md
    python scripts/gen_api_docs.py --check    # exit 1 if docs/api.md is not what this script generates

The public API is ``cpkv.__all__`` (grouped by the module that defines each name; type
aliases such as ``Layout`` by :data:`ALIAS_MODULES`), then the modules of :data:`EXTRA_MODULES`
(their ``__all__`` or the listed names), then every other name in the ``__all__`` of a public
module (no ``_`` in its dotted name) that is not documented yet, in the section of that
module. So every name a public module exports is here; importing the modules needs neither
torch_npu, triton, transformers nor a GPU (they are imported lazily). The notebooks' helpers
(``examples/cp_helpers.py``) are not part of the package and not documented here. The output
depends only on the code (names, signatures, docstrings), never on the machine, the time or
dictionary order, so the check is stable; tests/test_docs.py runs it in CI.
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import inspect
import re
import sys
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "api.md"

# Reading order of the modules; modules not listed here are appended, sorted by name.
# The data flow: the plan package, then the executor, the backends' primitives, the collectives.
MODULE_ORDER = [
    "cpkv.plan.conventions",
    "cpkv.plan.sharding",
    "cpkv.plan.layouts",
    "cpkv.plan.balance",
    "cpkv.plan.prefix",
    "cpkv.plan.segments",
    "cpkv.plan.routes",
    "cpkv.plan.attention",
    "cpkv.attention_spec",
    "cpkv.attention",
    "cpkv.compress_mode",
    "cpkv.backends.base",
    "cpkv.merge",
    "cpkv.collectives",
    "cpkv.comm",
    "cpkv.exchange",
]
# Type aliases (``Literal[...]``) carry no ``__module__`` of their own: the module that defines each.
ALIAS_MODULES = {
    "Layout": "cpkv.plan.attention",
    "Exchange": "cpkv.plan.attention",
    "BackendName": "cpkv.backends.base",
    "Group": "cpkv.collectives",
}
# Public modules documented as a whole (their __all__) or by the listed names.
EXTRA_MODULES: list[tuple[str, list[str] | None]] = [
    ("cpkv.plan", ["KVSource", "RingRound", "CompressedRoutes", "plan_routes", "contiguous_layout", "zigzag_layout"]),
    ("cpkv.plan.need", None),
    ("cpkv.v4", None),
    ("cpkv.backends", None),
    ("cpkv.backends.reference", None),
    ("cpkv.backends.cuda", None),
    ("cpkv.backends.triton", None),
    ("cpkv.backends.npu", None),
    ("cpkv.backends.npu_fused", None),
    ("cpkv.indexer_loss", None),
    ("cpkv.agreement", ["agree", "agree_in_order", "group_device"]),
    ("cpkv.index_keys", ["round_index_keys", "exchange_index_keys", "INDEX_KEY_DTYPES"]),
    ("cpkv.integrations.megatron", None),
    ("cpkv.integrations.megatron_attention", None),
    ("cpkv.integrations.transformers", None),
    ("cpkv.integrations.transformers_lm", None),
    ("cpkv.integrations.causal_lm", None),
    ("cpkv.launch", ["spawn", "RankError"]),
    ("cpkv.commstats", ["count_bytes", "ByteCounter"]),
]
SECTION = re.compile(
    r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Shapes|Shape legend|Note|Notes|Example|Examples)"
    r"( \([^)]*\))?:\s*(.*)$"
)
# A new entry of an Args/Attributes/Raises list: ``name: ...``, ``a, b: ...``, ``ValueError, TypeError: ...``.
ENTRY = re.compile(r"^\**[A-Za-z_][\w.]*(, \**[A-Za-z_][\w.]*)*( \([^)]*\))?:(\s|$)")
ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|obj):`~?([^`]+)`")
LIST_SECTIONS = ("Args", "Arguments", "Attributes", "Raises")


def _annotation(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return ""
    if isinstance(value, typing.ForwardRef):  # NamedTuple fields under ``from __future__ import annotations``
        return value.__forward_arg__
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _default(value: Any) -> str:
    text = repr(value)
    if " at 0x" in text:
        raise ValueError(f"default {text} is not deterministic; give it a stable repr")
    return text


def signature(obj: Callable[..., Any], name: str, *, returns: bool = True, method: bool = False) -> str | None:
    """``name(params) -> return`` from the unevaluated annotations, or None if there is none.

    ``method``: drop the leading ``self`` / ``cls`` of a function taken from a class ``__dict__``.
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if method and params and params[0].name in ("self", "cls"):
        sig = sig.replace(parameters=params[1:])
    parts: list[str] = []
    seen_kw_only = False
    for i, param in enumerate(sig.parameters.values()):
        if param.kind is param.KEYWORD_ONLY and not seen_kw_only:
            parts.append("*")
            seen_kw_only = True
        if param.kind is param.VAR_POSITIONAL:
            seen_kw_only = True
        stars: dict[Any, str] = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}
        prefix = stars.get(param.kind, "")
        text = prefix + param.name
        annotation = _annotation(param.annotation)
        if annotation:
            text += f": {annotation}"
        if param.default is not param.empty:
            text += f" = {_default(param.default)}" if annotation else f"={_default(param.default)}"
        parts.append(text)
        if param.kind is param.POSITIONAL_ONLY and (
            i + 1 == len(sig.parameters) or list(sig.parameters.values())[i + 1].kind is not param.POSITIONAL_ONLY
        ):
            parts.append("/")
    result = f"{name}({', '.join(parts)})"
    annotation = _annotation(sig.return_annotation) if returns else ""
    return f"{result} -> {annotation}" if annotation else result


def docstring_markdown(doc: str | None) -> list[str]:
    """Google-style docstring -> Markdown: prose as is, Args/Returns/... as bullets, examples as code."""
    if not doc:
        return ["*(no docstring)*", ""]
    lines = ROLE.sub(lambda m: f"``{m.group(1).rsplit('.', 1)[-1]}``", inspect.cleandoc(doc)).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = SECTION.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        title, rest = match.group(0).split(":", 1)[0], match.group(3)
        body: list[str] = [rest] if rest else []
        i += 1
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        out.extend(_section(title, body))
    while out and not out[-1].strip():
        out.pop()
    return [*out, ""]


def _section(title: str, body: list[str]) -> list[str]:
    indent = min((len(line) - len(line.lstrip()) for line in body if line.strip()), default=0)
    body = [line[indent:] if line.strip() else "" for line in body]
    if title.startswith("Example"):
        return ["", f"**{title}:**", "", "```python", *body, "```", ""]
    if not title.startswith(LIST_SECTIONS):
        return ["", f"**{title}:**", "", *[line.strip() for line in body], ""]
    bullets: list[str] = []
    for line in body:
        if not line.strip():
            continue
        if bullets and (line.startswith((" ", "\t")) or not ENTRY.match(line)):
            bullets[-1] += " " + line.strip()
        else:
            bullets.append(line.strip())
    return ["", f"**{title}:**", "", *[f"- {bullet}" for bullet in bullets], ""]


def _members(cls: type) -> Iterable[tuple[str, Any]]:
    """Public methods and properties defined (and documented) in ``cls`` itself, in source order."""
    for name, value in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property) or inspect.isfunction(value):
            if inspect.getdoc(value):
                yield name, value


def _custom_op(obj: Any) -> tuple[Callable[..., Any], str] | None:
    """``(the decorated function, "namespace::name")`` of a ``torch.library.custom_op``, else None."""
    function, name = getattr(obj, "_init_fn", None), getattr(obj, "_qualname", None)
    if type(obj).__name__ == "CustomOpDef" and callable(function) and isinstance(name, str):
        return function, name
    return None


def document(qualname: str, obj: Any) -> list[str]:
    """The Markdown section of one public name."""
    op = _custom_op(obj)
    if op is not None:  # document the function it wraps (CustomOpDef's own docstring is torch's)
        function, op_name = op
        lines = document(qualname, function)
        return [*lines, f"A `torch.library` custom op, also `torch.ops.{op_name.replace('::', '.')}`.", ""]
    is_alias = typing.get_origin(obj) is not None  # Literal[...] and other typing aliases
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) and not is_alias else "data"
    lines = [f"### `{qualname}`", ""]
    short = qualname.rsplit(".", 1)[-1]
    is_protocol = inspect.isclass(obj) and getattr(obj, "_is_protocol", False)
    sig = None
    if kind == "function" or (kind == "class" and not is_protocol and not issubclass(obj, enum.Enum)):
        sig = signature(obj, short, returns=kind != "class")
    if sig:
        lines += ["```python", f"{'class ' if kind == 'class' else ''}{sig}", "```", ""]
    elif kind == "class":
        lines += ["```python", f"class {short}{' (Protocol)' if is_protocol else ''}", "```", ""]
    if kind == "data":
        lines += [f"`{short} = {_default(obj)}`", ""]
        return lines
    lines += docstring_markdown(inspect.getdoc(obj) if kind != "class" else obj.__doc__)
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        lines += ["**Members:** " + ", ".join(f"`{m.name}` (`{m.value!r}`)" for m in obj), ""]
    if inspect.isclass(obj):
        for name, member in _members(obj):
            if isinstance(member, property):
                lines += [f"#### `{short}.{name}` (property)", ""]
            else:
                member_sig = signature(member, f"{short}.{name}", method=True)
                lines += [f"#### `{short}.{name}`", "", "```python", member_sig or f"{short}.{name}(...)", "```", ""]
            lines += docstring_markdown(inspect.getdoc(member))
    return lines


def collect() -> list[tuple[str, str, list[tuple[str, Any]]]]:
    """``(module name, module docstring, [(public qualified name, object), ...])`` in reading order."""
    import cpkv

    groups: dict[str, list[tuple[str, Any]]] = {}
    for name in sorted(cpkv.__all__):
        obj = getattr(cpkv, name)
        module = ALIAS_MODULES.get(name, getattr(obj, "__module__", ""))
        if not module.startswith("cpkv"):
            raise ValueError(f"cpkv.{name}: defined in {module!r}; add its cpkv module to ALIAS_MODULES")
        groups.setdefault(module, []).append((f"cpkv.{name}", obj))
    order = [m for m in MODULE_ORDER if m in groups] + sorted(set(groups) - set(MODULE_ORDER))
    result = [(module, inspect.getdoc(importlib.import_module(module)) or "", groups[module]) for module in order]
    for module_name, names in EXTRA_MODULES:
        module = importlib.import_module(module_name)
        chosen = names if names is not None else sorted(module.__all__)
        result.append((module_name, inspect.getdoc(module) or "", [(f"{module_name}.{n}", getattr(module, n)) for n in chosen]))
    documented = {id(obj) for _, _, items in result for _, obj in items}
    sections = {module: items for module, _, items in result}
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        missing = [(f"{module_name}.{n}", getattr(module, n)) for n in sorted(module.__all__)]
        missing = [(q, obj) for q, obj in missing if id(obj) not in documented]
        documented |= {id(obj) for _, obj in missing}
        if missing and module_name in sections:
            sections[module_name].extend(missing)
        elif missing:
            sections[module_name] = missing
            result.append((module_name, inspect.getdoc(module) or "", missing))
    return result


def public_modules() -> list[str]:
    """The dotted names of cpkv's public modules that declare ``__all__``, sorted (read from the source, not imported)."""
    package = ROOT / "cpkv"
    names: list[str] = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if any(part.startswith("_") for part in parts):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
               for node in tree.body):
            names.append(".".join(parts))
    return sorted(names)


def render() -> str:
    """The whole of docs/api.md."""
    import cpkv

    sections = collect()
    lines = [
        "# cpkv API reference",
        "",
        "<!-- Generated by scripts/gen_api_docs.py from the docstrings. Do not edit by hand:"
        " run `python scripts/gen_api_docs.py` (CI runs it with --check). -->",
        "",
        f"cpkv {cpkv.__version__}. Everything below is importable as shown; the names under `cpkv.*` are "
        "`cpkv.__all__`, and every name in the `__all__` of a public module is here. Conventions (leading-zero `cu_seqlens`, Ascend `actual_seq_*`, layouts, groups) "
        "are explained in [conventions.md](conventions.md), what every operation computes in "
        "[semantics.md](semantics.md), how the modules fit together in [design.md](design.md).",
        "",
        "## Contents",
        "",
    ]
    for module, _, items in sections:
        anchor = module.replace(".", "")
        lines.append(f"- [`{module}`](#{anchor}): " + ", ".join(f"`{q.rsplit('.', 1)[-1]}`" for q, _ in items))
    lines.append("")
    for module, doc, items in sections:
        lines += [f"## {module}", ""]
        lines += docstring_markdown(doc)
        for qualname, obj in items:
            lines += document(qualname, obj)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale instead of writing it")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where the reference lives (default docs/api.md)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run `python scripts/gen_api_docs.py` and commit the result", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
