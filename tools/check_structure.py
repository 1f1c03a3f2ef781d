"""The structure measures of issue #15, printed and checked (``make lint``, and a test:
tests/build/test_structure.py).

1. no import cycle between the modules of python/peak (imports parsed with ast, the ones inside
   functions included: a lazy import is still a dependency);
2. no module of python/peak/amp reads a private name (``_x``) of another peak module;
3. no file in python/peak or csrc over MAX_LINES lines;
4. python/peak/amp plus the scaling core at most AMP_CEILING lines, printed against issue 15's
   target AMP_BUDGET;
5. the C++ op layer: one TORCH_LIBRARY(peak) block; nothing in csrc/ops or csrc/core includes
   csrc/bindings; the test-only twins (peak_emulated, peak._C.emulated) only in csrc/testing,
   which CMake builds only under PEAK_TEST_TWINS; torch.ops.peak called only by peak/ops.py.

Exit status 1 when a check fails. ``--known FILE`` (repeatable) tolerates an over-long file that
is being reduced elsewhere: it is still printed, marked "known".
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "peak"
MAX_LINES = 600
AMP_BUDGET = 3400  # issue 15's target for python/peak/amp + the scaling core
# Where amp stands now: the check fails above it, so amp cannot grow back while it is brought
# down to AMP_BUDGET. Lower it with every reduction (never raise it to make room). (3,870 before
# the issue-15 budget branch: amp's LossScaler merged into handle.py, _options.py and amp.init
# into frontend.py, dead code and prose moved to docs/, every line over 100 columns wrapped; 3,628
# before issue15-budget2: _scaler_inputs.py folded into grad_scaler.py and scaling.py, GradScaler's
# torch-identical methods run torch's code over peak's state from one table, torch's _cast reused,
# hand-written group loops replaced by the core's unscale_grads_: 3,400, so the ceiling is now the
# target itself, which it may not go below: tests/build/test_structure.py.)
AMP_CEILING = 3400
# python/peak's size when issue 25 was filed, which its redesign should not exceed (printed).
PACKAGE_LINES_BOUND = 6989
# The scaling core counted with python/peak/amp: peak/scaling.py. FP16_Optimizer
# (fp16_utils/fp16_optimizer.py) is one of its front doors, as GradScaler and LossScaler are (those
# two are counted because they live in amp), not part of the core.
SCALING_CORE = ("python/peak/scaling.py",)
# Private names other modules may read: the compiled extension (peak._C) and Apex's
# ``amp._amp_state`` (Apex scripts use that very name, so it cannot lose its underscore).
PRIVATE_ALLOWED = {"_C", "_amp_state"}
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".cu", ".cuh"}
# Modules that exist only after the build (the compiled extension, the generated build facts):
# importing them is importing a leaf, not the package they sit in.
BUILT_MODULES = ("peak._C", "peak._build_info")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    modules = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    for name in BUILT_MODULES:
        modules.setdefault(name, None)
    return modules


def _resolve(current: str, is_package: bool, level: int, module: str | None) -> str:
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]):
    """(imported peak module, names taken from it, line) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "peak":
                    yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = _resolve(name, is_package, node.level, node.module)
            else:
                target = node.module or ""
            if target.split(".")[0] != "peak":
                continue
            names = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:  # `from . import lists`: a module, not a name in one
                    yield sub, [], node.lineno
                else:
                    names.append(alias.name)
            if names:
                yield target, names, node.lineno


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path is None:  # a built module: imports nothing of peak's
            graph[name] = set()
            continue
        deps = set()
        for target, _names, _line in imports_of(name, path, modules):
            # importing peak.a.b runs peak.a's __init__ first, but that is not a dependency of
            # the importer's code on peak.a: only the module itself is counted.
            if target in modules and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def private_reads(modules: dict[str, Path], scope: str = "peak.amp") -> list[str]:
    """``from .x import _name`` and ``x._name`` where x is another peak module, in ``scope``."""
    found = []
    for name, path in modules.items():
        if path is None or not (name == scope or name.startswith(scope + ".")):
            continue
        aliases: dict[str, str] = {}  # local name -> peak module
        for target, names, line in imports_of(name, path, modules):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and n not in PRIVATE_ALLOWED:
                    found.append(f"{path.relative_to(ROOT)}:{line}: from {target} import {n}")
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = _resolve(name, path.name == "__init__.py", node.level, node.module)
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("peak") and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in PRIVATE_ALLOWED
                    and aliases[node.value.id] != name):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                             f"{node.value.id}.{node.attr}")
    return found


# Private names one peak package may touch on another's objects (measure 6), each with its
# reason: Apex's own names that user scripts touch; torch's protocols, which peak's classes
# implement under torch's names.
PRIVATE_ATTRIBUTE_ALLOWLIST = {
    "_amp_stash": "Apex's per-optimizer amp state; Apex scripts read optimizer._amp_stash",
    "_amp_state": "Apex's global amp state; Apex scripts read amp._amp_state",
    "_C": "the compiled extension",
    "_step_supports_amp_scaling": "torch's attribute: the step takes grad_scale/found_inf",
    "_check_inf_per_device": "torch's GradScaler method; Apex's step(closure, grad_scaler) calls it",
    "_get_scale_async": "torch's GradScaler method; Apex's step(closure, grad_scaler) calls it",
    "_enabled": "torch's GradScaler attribute; Apex's step(closure, grad_scaler) reads it",
    "_optimizer_state_dict_post_hooks": "torch's Optimizer attribute (set by its __init__)",
    "_dtype": "torch's custom_fwd contract: ctx._dtype, which torch's custom_bwd reads",
}


def package_of(module: str) -> str:
    """peak.amp.handle -> peak.amp; a top-level module (peak.scaling) is a package of its own."""
    return ".".join(module.split(".")[:2])


def _private_names_defined(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)  # (obj._x = ... on another's object is an access, not a definition)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
        if isinstance(node, ast.Name) and node.id in ("self", "cls"):
            return node.id  # self._x.y: the own object's attribute first
    return node.id if isinstance(node, ast.Name) else None


def private_attribute_accesses(modules: dict[str, Path]) -> tuple[list[str], list[str]]:
    """``obj._name`` (and ``getattr(obj, "_name")``...) in a peak package, where ``_name`` is
    defined by another peak package only: the contract between packages must be public names.
    Returns (accesses outside the allowlist, allowlisted accesses)."""
    trees = {name: ast.parse(path.read_text(), str(path))
             for name, path in modules.items() if path is not None}
    defined: dict[str, set[str]] = {}
    for name, tree in trees.items():
        defined.setdefault(package_of(name), set()).update(_private_names_defined(tree))
    found, allowed = [], []
    for name, tree in trees.items():
        own = defined[package_of(name)]
        others = set().union(*(d for pkg, d in defined.items() if pkg != package_of(name)))
        for node in ast.walk(tree):
            attr = None
            if isinstance(node, ast.Attribute) and _root_name(node) not in ("self", "cls",
                                                                             "torch"):
                attr = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                attr = node.args[1].value
            if attr is None or attr not in others or attr in own:
                continue
            path = modules[name]
            rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            where = f"{rel}:{node.lineno}: .{attr}"
            (allowed if attr in PRIVATE_ATTRIBUTE_ALLOWLIST else found).append(where)
    return found, allowed


def ownership_measures() -> dict[str, list[str]]:
    """Issue 25's measures of the master weights and the overflow flags, found in the source:

    - makers of master weights: modules that call ``new_master(`` or build an ``nn.Parameter(``
      (peak.optimizers.masters is the owner; fp16util's ``prep_param_lists`` is Apex's manual
      recipe, which hands fp32 copies to the caller and keeps none);
    - master -> model copies: calls of ``multi_tensor_scale_`` with a literal scale of 1.0 or
      ``unscale_grads_(masters, 1.0, ..., outputs=...)``, and per-tensor ``model.copy_(master)``;
    - flag merges: functions that sum overflow flags of several devices or optimizers into one
      (Python and C++)."""
    patterns = {
        "makers of master weights": re.compile(r"new_master\(|nn\.Parameter\("),
        "master -> model copies": re.compile(
            r"multi_tensor_scale_\([^)]*,\s*1\.0\s*,|unscale_grads_\([^)]*1\.0[^)]*outputs=|"
            r"\.copy_\(master\)"),
        "flag merges": re.compile(r"^\s*def sum_flags\(|merged_found_inf\(at::TensorList|"
                                  r"merge_found_infs\(at::TensorList|sum\(f\.to\(", re.M),
    }
    found: dict[str, list[str]] = {k: [] for k in patterns}
    files = [p for d in (PACKAGE, ROOT / "csrc") for p in sorted(d.rglob("*"))
             if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    for path in files:
        text = path.read_text()
        for key, pattern in patterns.items():
            n = len(pattern.findall(text))
            if n:
                found[key].append(f"{path.relative_to(ROOT)} ({n})")
    return found


def line_count(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def long_files() -> list[tuple[str, int]]:
    files = [p for d in (PACKAGE, ROOT / "csrc") for p in d.rglob("*")
             if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    counts = [(str(p.relative_to(ROOT)), line_count(p)) for p in files]
    return sorted((c for c in counts if c[1] > MAX_LINES), key=lambda c: -c[1])


def amp_lines() -> tuple[int, list[tuple[str, int]]]:
    files = sorted((PACKAGE / "amp").rglob("*.py"))
    files += [ROOT / f for f in SCALING_CORE if (ROOT / f).exists()]
    counts = [(str(p.relative_to(ROOT)), line_count(p)) for p in files]
    return sum(c for _, c in counts), counts


def op_layer_problems() -> list[str]:
    """What breaks measure 5 (empty when the op layer is as designed)."""
    problems = []
    csrc = ROOT / "csrc"
    sources = [p for p in sorted(csrc.rglob("*")) if p.suffix in SOURCE_SUFFIXES]
    blocks = [str(p.relative_to(ROOT)) for p in sources
              for line in p.read_text().splitlines() if line.startswith("TORCH_LIBRARY(peak,")]
    if len(blocks) != 1:
        problems.append(f"TORCH_LIBRARY(peak, ...) blocks: {blocks} (want exactly one)")
    for p in sources:
        rel = p.relative_to(csrc)
        text = p.read_text()
        if rel.parts[0] in ("ops", "core") and "bindings/" in "".join(
                line for line in text.splitlines() if line.startswith("#include")):
            problems.append(f"csrc/{rel} includes from csrc/bindings")
        if rel.parts[0] != "testing" and ("TORCH_LIBRARY(peak_emulated" in text
                                          or "struct EmulatedExec" in text):
            problems.append(f"csrc/{rel} holds test-only twin code (belongs in csrc/testing)")
    cmake = (ROOT / "CMakeLists.txt").read_text()
    guarded = cmake.split("if(PEAK_TEST_TWINS)", 1)
    if "csrc/testing/emulated" in guarded[0] or len(guarded) < 2:
        problems.append("CMakeLists.txt builds csrc/testing outside if(PEAK_TEST_TWINS)")
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "ops.py" and "torch.ops.peak" in path.read_text():
            problems.append(f"{path.relative_to(ROOT)} calls torch.ops.peak "
                            "(peak.ops is the way in)")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--known", action="append", default=[],
                        help="an over-long file being reduced elsewhere (printed, not failed)")
    args = parser.parse_args(argv)
    failed = False
    modules = package_modules()

    cycles = find_cycles(import_graph(modules))
    print(f"import cycles in python/peak: {len(cycles)}")
    for c in cycles:
        print("  cycle:", " <-> ".join(c))
    failed |= bool(cycles)

    private = private_reads(modules)
    print(f"private names of other modules read in python/peak/amp: {len(private)}")
    for p in private:
        print("  ", p)
    failed |= bool(private)

    accesses, allowed = private_attribute_accesses(modules)
    print(f"private attributes of another peak package touched: {len(accesses)} "
          f"(+{len(allowed)} on the allowlist)")
    for p in accesses:
        print("  ", p)
    for p in allowed:
        print("   allowed:", p)
    failed |= bool(accesses)

    for key, where in ownership_measures().items():
        print(f"{key}: in {len(where)} files: {', '.join(where)}")
    total_lines = sum(line_count(p) for p in PACKAGE.rglob("*.py"))
    print(f"python/peak: {total_lines} lines (issue 25's bound: {PACKAGE_LINES_BOUND})")

    long = long_files()
    print(f"files over {MAX_LINES} lines in python/peak and csrc: {len(long)}")
    for f, n in long:
        known = f in args.known
        print(f"  {n:6d}  {f}{'  (known: being reduced elsewhere)' if known else ''}")
        failed |= not known

    total, counts = amp_lines()
    print(f"python/peak/amp + scaling core: {total} lines (ceiling {AMP_CEILING}, "
          f"target <= {AMP_BUDGET})")
    for f, n in counts:
        print(f"  {n:6d}  {f}")
    if total > AMP_CEILING:
        print(f"  over the ceiling by {total - AMP_CEILING}: amp grew; bring it back down")
        failed = True
    elif total > AMP_BUDGET:
        print(f"  {total - AMP_BUDGET} lines over issue 15's target (under the ceiling)")

    problems = op_layer_problems()
    print(f"C++ op layer (one TORCH_LIBRARY block, ops apart from bindings, test twins apart): "
          f"{len(problems)} problems")
    for p in problems:
        print("  ", p)
    failed |= bool(problems)

    print("structure: " + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
