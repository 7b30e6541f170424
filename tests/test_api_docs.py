"""Every public function and class has a docstring, and every public function type annotations on
all its parameters and its return: attention_ext.__all__ plus the public names of the modules users
import from (the families, their references, compat, nn, models, viz). Public: no leading
underscore, a function or class defined in attention_ext (re-exported torch or typing names are
not ours to document). viz imports matplotlib only when it plots, so the walk needs no extra."""
import importlib
import inspect
import typing

import pytest

import attention_ext

MODULES = ("attention_ext.nn", "attention_ext.compat", "attention_ext.compat.flash_attn", "attention_ext.compat.sdpa",
           "attention_ext.decode", "attention_ext.linear", "attention_ext.sparse", "attention_ext.softmax", "attention_ext.models",
           "attention_ext.reference", "attention_ext.softmax.reference", "attention_ext.linear.reference",
           "attention_ext.sparse.reference", "attention_ext.decode.reference", "attention_ext.linear.feature_maps",
           "attention_ext.sparse.layouts", "attention_ext.viz", "attention_ext.distributed",
           "attention_ext.distributed.sharding", "attention_ext.distributed.attention")


def _ours(obj):
    return (inspect.isfunction(obj) or inspect.isclass(obj)) and (obj.__module__ or "").startswith("attention_ext")


def public_api():
    """{qualified name: object}, each object once (under the first name it is found by)."""
    found, seen = {}, set()

    def add(prefix, name, obj):
        if _ours(obj) and id(obj) not in seen:
            seen.add(id(obj))
            found[f"{prefix}.{name}"] = obj

    for name in attention_ext.__all__:
        add("attention_ext", name, getattr(attention_ext, name))
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        for name in sorted(vars(mod)):
            if not name.startswith("_"):
                add(mod_name, name, getattr(mod, name))
    return found


API = public_api()


def test_api_found():
    for name in ("attention_ext.attention", "attention_ext.nn.MultiheadAttention", "attention_ext.decode.decode_fwd",
                 "attention_ext.linear_attention", "attention_ext.sparse.bigbird"):
        assert name in API, name
    assert len(API) > 50


def _missing_annotations(fn):
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values()
               if p.annotation is inspect.Parameter.empty and p.name not in ("self", "cls")]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def test_docstrings():
    bad = [name for name, obj in API.items() if not (inspect.getdoc(obj) or "").strip()]
    assert not bad, f"no docstring: {bad}"


def test_annotations():
    bad = {name: m for name, obj in API.items() if inspect.isfunction(obj) and (m := _missing_annotations(obj))}
    assert not bad, "missing annotations:\n" + "\n".join(f"  {k}: {v}" for k, v in bad.items())


def test_annotations_resolve():
    """The annotations name real objects (they are strings under `from __future__ import annotations`)."""
    for name, obj in API.items():
        if inspect.isfunction(obj):
            typing.get_type_hints(obj)
