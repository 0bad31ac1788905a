"""The type stubs (python/fabric_lib/_fabric_lib.pyi) match the compiled module exactly, and
every call the module offers has a docstring."""

import ast
import inspect
import re
from pathlib import Path

import fabric_lib
import fabric_lib.distributed
import fabric_lib._fabric_lib as ext

STUB = Path(ext.__file__).with_name("_fabric_lib.pyi")

# Attributes every module or class has, that no stub spells out.
MODULE_NOISE = {"__name__", "__doc__", "__package__", "__loader__", "__spec__", "__file__"}
# Attributes pybind11 itself puts on every class (the conduit method is pybind11 3's
# cross-module interop hook), not part of fabric_lib's API.
CLASS_NOISE = {"__doc__", "__module__", "__dict__", "__weakref__", "__entries",
               "_pybind11_conduit_v1_"}


def split_params(text):
    """Splits a parameter list at top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_signature(line, drop_self):
    """'f(self: T, a: int, *, b: int = 0) -> R' -> [('a', 'pos', False), ('b', 'kw', True)]."""
    m = re.match(r"^\w+\((.*)\) -> .*$", line)
    assert m, f"not a pybind11 signature: {line!r}"
    params, kind = [], "pos"
    for p in split_params(m.group(1)):
        if p == "/":  # pybind11 3 marks positional-only parameters; they are "pos" already
            continue
        if p == "*":
            kind = "kw"
            continue
        if p.startswith("**"):
            params.append((p[2:].split(":")[0], "varkw", False))
            continue
        if p.startswith("*"):
            params.append((p[1:].split(":")[0], "var", False))
            kind = "kw"
            continue
        name = p.split(":")[0].split("=")[0].strip()
        params.append((name, kind, "=" in p))
    if drop_self and params and params[0][0] == "self":
        params = params[1:]
    return params


def runtime_signatures(fn, drop_self):
    """Every signature of a pybind11 function (several when overloaded)."""
    lines = (fn.__doc__ or "").splitlines()
    if len(lines) > 1 and lines[1] == "Overloaded function.":
        sigs = [re.sub(r"^\d+\. ", "", l) for l in lines if re.match(r"^\d+\. \w+\(", l)]
    else:
        sigs = [lines[0]]
    return distinct(parse_signature(s, drop_self) for s in sigs)


def distinct(signatures):
    """Sorted, without repeats: overloads that differ only in types read the same here (and
    pybind11 versions differ in which of those they list)."""
    unique = []
    for sig in sorted(signatures):
        if sig not in unique:
            unique.append(sig)
    return unique


def stub_signature(node, drop_self):
    a = node.args
    params = []
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        params.append((arg.arg, "pos", i >= first_default))
    if a.vararg:
        params.append((a.vararg.arg, "var", False))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append((arg.arg, "kw", default is not None))
    if a.kwarg:
        params.append((a.kwarg.arg, "varkw", False))
    if drop_self and params and params[0][0] == "self":
        params = params[1:]
    return params


def decorators(node):
    names = []
    for d in node.decorator_list:
        if isinstance(d, ast.Name):
            names.append(d.id)
        elif isinstance(d, ast.Attribute):
            names.append(d.attr)  # x.setter
    return names


def check_class(node, cls, where, problems):
    """Compares one stub class with its runtime class; appends differences to `problems`."""
    path = f"{where}{node.name}"
    runtime_bases = [b.__name__ for b in cls.__bases__ if b.__name__ != "pybind11_object"]
    stub_bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
    if runtime_bases != stub_bases and not (runtime_bases == ["object"] and not stub_bases):
        problems.append(f"{path}: bases {stub_bases} in the stub, {runtime_bases} at run time")
    is_exception = issubclass(cls, BaseException)
    runtime = {k: v for k, v in vars(cls).items() if k not in CLASS_NOISE}
    # pybind11's placeholder __init__ of classes without a constructor is not spelled out.
    init = runtime.get("__init__")
    if init is not None and (init.__doc__ or "").startswith("Initialize self"):
        del runtime["__init__"]

    stub_members = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            stub_members.setdefault(item.name, []).append(item)
        elif isinstance(item, ast.AnnAssign):
            stub_members.setdefault(item.target.id, []).append(item)
        elif isinstance(item, ast.ClassDef):
            stub_members.setdefault(item.name, []).append(item)
    if is_exception:
        # code and message are instance attributes set when the library raises.
        stub_members = {k: v for k, v in stub_members.items() if not isinstance(v[0], ast.AnnAssign)}

    for name in sorted(set(runtime) - set(stub_members)):
        problems.append(f"{path}.{name}: at run time, missing from the stub")
    for name in sorted(set(stub_members) - set(runtime)):
        problems.append(f"{path}.{name}: in the stub, missing at run time")
    for name in sorted(set(runtime) & set(stub_members)):
        value, nodes = runtime[name], stub_members[name]
        first = nodes[0]
        if isinstance(first, ast.ClassDef):
            check_class(first, value, f"{path}.", problems)
        elif isinstance(first, ast.AnnAssign):
            if inspect.isroutine(value) or type(value) is property:
                problems.append(f"{path}.{name}: a plain attribute in the stub, not at run time")
        elif "property" in decorators(first):
            if type(value) is not property:
                problems.append(f"{path}.{name}: a property in the stub, not at run time")
                continue
            stub_settable = any("setter" in decorators(n) for n in nodes)
            if stub_settable != (value.fset is not None):
                problems.append(f"{path}.{name}: settable in the stub {stub_settable}, at run "
                                f"time {value.fset is not None}")
        else:
            static = isinstance(inspect.getattr_static(cls, name), staticmethod)
            if static != ("staticmethod" in decorators(first)):
                problems.append(f"{path}.{name}: static in one and not the other")
            fn = getattr(cls, name)
            want = runtime_signatures(fn, drop_self=not static)
            got = distinct(stub_signature(n, drop_self=not static) for n in nodes)
            if want != got:
                problems.append(f"{path}.{name}: parameters {got} in the stub, {want} at run time")


def test_stub_matches_module_exactly():
    tree = ast.parse(STUB.read_text())
    problems = []
    stub_names = {}
    for item in tree.body:
        if isinstance(item, (ast.FunctionDef, ast.ClassDef)):
            stub_names[item.name] = item
        elif isinstance(item, ast.AnnAssign):
            stub_names[item.target.id] = item
        # Plain assignments are the stub's own type aliases (_BytesLike, ...).
    runtime = {k: v for k, v in vars(ext).items() if k not in MODULE_NOISE}
    for name in sorted(set(runtime) - set(stub_names)):
        problems.append(f"{name}: in the module, missing from the stub")
    for name in sorted(set(stub_names) - set(runtime)):
        problems.append(f"{name}: in the stub, missing from the module")
    for name in sorted(set(runtime) & set(stub_names)):
        node, value = stub_names[name], runtime[name]
        if isinstance(node, ast.ClassDef):
            if not inspect.isclass(value):
                problems.append(f"{name}: a class in the stub only")
            else:
                check_class(node, value, "", problems)
        elif isinstance(node, ast.FunctionDef):
            if not inspect.isroutine(value):
                problems.append(f"{name}: a function in the stub only")
            elif runtime_signatures(value, False) != [stub_signature(node, False)]:
                problems.append(f"{name}: parameters differ: stub {stub_signature(node, False)}, "
                                f"run time {runtime_signatures(value, False)}")
        elif inspect.isroutine(value) or inspect.isclass(value):
            problems.append(f"{name}: a plain attribute in the stub only")
    assert not problems, "the stub does not match the module:\n" + "\n".join(problems)


def test_stub_catches_a_difference():
    """The checker itself: a stub with a renamed parameter is reported."""
    tree = ast.parse(STUB.read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TransferEngine")
    wait = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "wait_imm")
    wait.args.args[2].arg = "count"
    problems = []
    check_class(engine, ext.TransferEngine, "", problems)
    assert any("wait_imm" in p for p in problems), problems


def test_package_exports_the_module():
    public = {k for k in vars(ext) if not k.startswith("_")} | {"__version__"}
    assert public <= set(fabric_lib.__all__), public - set(fabric_lib.__all__)
    for name in fabric_lib.__all__:
        assert hasattr(fabric_lib, name), name


def documented(obj):
    """The docstring says more than the signature pybind11 writes."""
    doc = inspect.getdoc(obj) or ""
    lines = [l for l in doc.splitlines() if l.strip()]
    if lines and re.match(r"^\w+\(.*\) -> ", lines[0]):
        lines = lines[1:]
    return bool(lines)


def test_every_call_has_a_docstring():
    missing = []
    for name, value in vars(ext).items():
        if name.startswith("__"):
            continue
        if inspect.isroutine(value) and not documented(value):
            missing.append(name)
        if inspect.isclass(value):
            if not documented(value):
                missing.append(name)
            if issubclass(value, BaseException) or hasattr(value, "__members__"):
                continue  # exceptions and enums: the class docstring covers them
            for member, attr in vars(value).items():
                if member in CLASS_NOISE or (member.startswith("__")
                                             and member not in ("__init__", "__bytes__")):
                    continue
                if not (inspect.isroutine(attr) or isinstance(attr, property)):
                    continue  # constants and enum values
                if (attr.__doc__ or "").startswith("Initialize self"):
                    continue
                target = getattr(value, member) if inspect.isroutine(attr) else attr
                if not documented(target):
                    missing.append(f"{name}.{member}")
    for obj in (fabric_lib.Transfer, fabric_lib.Transfer.wait, fabric_lib.Transfer.cancel,
                fabric_lib.Expectation, fabric_lib.Expectation.cancel, fabric_lib.info,
                fabric_lib.Info, fabric_lib.distributed.all_gather_bytes,
                fabric_lib.distributed.exchange_addresses,
                fabric_lib.distributed.exchange_descriptors):
        if not documented(obj):
            missing.append(obj.__qualname__)
    assert not missing, f"no docstring: {missing}"
