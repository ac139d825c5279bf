#!/usr/bin/env python3
"""Checks the import structure of every crate in the workspace: no module circles, and in quotad
no domain module importing from the API layer.

Usage: python3 scripts/module-cycles.py [--include-tests] [--edges] [--root DIR]
Exit status: 0 when clean, 1 when any crate has a circle or quotad breaks the layer rule.

How it reads the code (Python 3.11 standard library only, no compiler):
- Crates are the workspace members of Cargo.toml; each library and binary target is one graph
  (src/lib.rs, src/main.rs, src/bin/*.rs, or the paths [lib] and [[bin]] give). Modules are
  found by following `mod name;` from the target's root, so a module is a file (`name.rs` or
  `name/mod.rs`). Inline `mod name { ... }` blocks belong to their file.
- An edge A -> B means a file A names a path into file B: `use crate::...`, `use super::...`,
  `use self::...`, a `use` of a child module, or an inline `crate::...`/`super::...` path in
  code. The path is resolved to the longest prefix that is a module; a name re-exported by a
  `pub use` (in lib.rs or a mod.rs facade) is followed to the module that defines it, so a
  re-export is an alias, not a dependency of the re-exporting module. Comments, strings and
  `$crate::` in macros are ignored.
- A module using its own submodules (a folder's mod.rs building its children, the crate root
  wiring everything) is containment, not an edge: the folder owns them. Its children using
  `super::` items (a trait, shared types) are edges, so a circle needs a path through a module
  the parent does not contain, which is what makes two parts impossible to read or change
  apart.
- Test code is left out: `#[cfg(test)] mod name { ... }` blocks and files declared by
  `#[cfg(test)] mod name;`. Unit tests beside the code may import their siblings' helpers; that
  is a test-build dependency, not a circle in the product's structure. `--include-tests` counts
  them as well.
- A circle is a strongly connected component of more than one module (Tarjan's algorithm).
- The layer rule for quotad: modules outside `api` (crates/quotad/src/api) must not import
  `crate::api` or anything under it, except the API layer's entry points in API_ENTRY_POINTS.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The crate whose domain modules must not import its API layer, the API layer's module, and the
# modules allowed to import it: the entry points that build and serve the API (the root and the
# binary are the crate's wiring). Paths are module paths; an entry covers its submodules.
LAYERED_CRATE = "quotad"
API_MODULE = "api"
API_ENTRY_POINTS = {"crate", "server", "envoy", "main", "lib", "cli"}


@dataclass
class Module:
    path: str  # "crate", "a", "a::b"
    file: Path
    is_test: bool
    text: str = ""  # code with comments and strings blanked
    children: dict[str, str] = field(default_factory=dict)  # name -> module path
    reexports: dict[str, str] = field(default_factory=dict)  # name -> full path it aliases
    uses: list[tuple[list[str], bool, int]] = field(default_factory=list)  # (path, is_pub, pos)
    inline_mods: list[tuple[int, int]] = field(default_factory=list)  # spans of `mod x { }`


def strip_comments_and_strings(src: str) -> str:
    """Blanks comments, string and char literals with spaces, keeping offsets and newlines."""
    out = list(src)
    i, n = 0, len(src)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:i + 80]) and (i == 0 or not is_ident(src[i - 1])):
            hashes = len(re.match(r"r(#*)", src[i:]).group(1))
            start = src.find('"', i) + 1
            end = src.find('"' + "#" * hashes, start)
            end = n if end < 0 else end + 1 + hashes
            blank(i, end)
            i = end
        elif c == "b" and src.startswith('b"', i) and (i == 0 or not is_ident(src[i - 1])):
            i += 1
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", src[i:i + 12])
            if m:  # a char literal; otherwise a lifetime
                blank(i, i + m.end())
                i += m.end()
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def is_ident(c: str) -> bool:
    return c.isalnum() or c == "_"


def match_brace(text: str, open_pos: int) -> int:
    """The offset just past the brace closing the one at open_pos."""
    depth = 0
    for k in range(open_pos, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k + 1
    return len(text)


CFG_TEST = r"#\[cfg\(\s*test\s*\)\]"
ATTRS = r"\s*(?:#\[[^\]]*\]\s*)*"
MOD_DECL = re.compile(
    rf"(?P<attrs>(?:#\[[^\]]*\]\s*)*)(?:pub(?:\([^)]*\))?\s+)?mod\s+(?P<name>\w+)\s*(?P<end>[;{{])"
)


def blank_test_blocks(text: str) -> str:
    """Blanks every `#[cfg(test)] mod x { ... }` block."""
    out = text
    for m in re.finditer(rf"{CFG_TEST}{ATTRS}(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{{", text):
        end = match_brace(text, m.end() - 1)
        out = out[: m.start()] + re.sub(r"[^\n]", " ", out[m.start():end]) + out[end:]
    return out


def inline_mod_spans(text: str) -> list[tuple[int, int]]:
    spans = []
    for m in MOD_DECL.finditer(text):
        if m.group("end") == "{":
            spans.append((m.end() - 1, match_brace(text, m.end() - 1)))
    return spans


def expand_use_tree(tree: str) -> list[list[str]]:
    """`a::{b, c::{d, e as f}, self}` -> [[a, b], [a, c, d], [a, c, e], [a]]."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)

    def split_top(s: str) -> list[str]:
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        if cur:
            parts.append(cur)
        return parts

    def walk(s: str, prefix: list[str]) -> list[list[str]]:
        if not s:
            return []
        brace = s.find("{")
        if brace >= 0 and s.endswith("}"):
            head = [p for p in s[:brace].split("::") if p]
            result = []
            for part in split_top(s[brace + 1:-1]):
                result.extend(walk(part, prefix + head))
            return result
        segs = [p for p in s.split("::") if p]
        if segs and segs[-1] == "self":
            segs = segs[:-1]
        return [prefix + segs]

    return walk(tree, [])


@dataclass
class Target:
    crate: str
    kind: str  # "lib" or "bin <name>"
    modules: dict[str, Module]


def load_target(crate: str, kind: str, root_file: Path, include_tests: bool) -> Target:
    modules: dict[str, Module] = {}

    def load(path: str, file: Path, is_test: bool) -> None:
        raw = file.read_text(encoding="utf-8")
        text = strip_comments_and_strings(raw)
        if not include_tests:
            text = blank_test_blocks(text)
        mod = Module(path, file, is_test, text)
        modules[path] = mod
        is_dir_owner = file.name in ("mod.rs", "lib.rs", "main.rs") or path == "crate"
        base = file.parent if is_dir_owner else file.parent / file.stem
        spans = inline_mod_spans(text)
        for m in MOD_DECL.finditer(text):
            if m.group("end") != ";" or any(a < m.start() < b for a, b in spans):
                continue
            name = m.group("name")
            child_test = bool(re.search(CFG_TEST, m.group("attrs")))
            if child_test and not include_tests:
                continue
            for cand in (base / f"{name}.rs", base / name / "mod.rs"):
                if cand.exists():
                    child = name if path == "crate" else f"{path}::{name}"
                    mod.children[name] = child
                    load(child, cand, is_test or child_test)
                    break
        use_spans = []
        for m in re.finditer(r"(?<![\w$])(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", text):
            use_spans.append((m.start(), m.end()))
            for segs in expand_use_tree(m.group(2)):
                segs = [s for s in segs if s]
                if segs and segs[0] == "::":
                    continue
                mod.uses.append((segs, bool(m.group(1)), m.start()))
        for m in re.finditer(r"(?<![\w$:])((?:crate|super|self)(?:::\w+)+)", text):
            if any(a <= m.start() < b for a, b in use_spans):
                continue  # already read as a use
            mod.uses.append((m.group(1).split("::"), False, m.start()))
        mod.inline_mods = spans

    load("crate", root_file, False)
    tgt = Target(crate, kind, modules)
    for mod in modules.values():
        for segs, is_pub, pos in mod.uses:
            full = absolute(tgt, mod, segs, pos) if is_pub and segs[-1] != "*" else None
            if full:
                mod.reexports[segs[-1]] = "::".join(full)
    return tgt


def inline_depth(mod: Module, pos: int) -> int:
    return sum(1 for a, b in mod.inline_mods if a < pos < b)


def parent_of(path: str) -> str:
    return "crate" if "::" not in path else path.rsplit("::", 1)[0]


def absolute(tgt: Target, mod: Module, segs: list[str], pos: int) -> list[str] | None:
    """The path as segments from the crate root, or None when it leaves the crate."""
    if not segs:
        return None
    depth = inline_depth(mod, pos)
    cur = mod.path
    i = 0
    if segs[0] == "crate":
        cur, i = "crate", 1
    elif segs[0] in ("super", "self"):
        while i < len(segs) and segs[i] in ("super", "self"):
            if segs[i] == "super":
                if depth > 0:
                    depth -= 1
                else:
                    cur = parent_of(cur)
            i += 1
    elif segs[0] not in mod.children:
        return None  # an extern crate, std, or a local item
    base = [] if cur == "crate" else cur.split("::")
    return ["crate"] + base + segs[i:]


def resolve(tgt: Target, full: list[str], seen: int = 0) -> str | None:
    """The module that defines the item a crate-absolute path names."""
    segs = full[1:]
    best, k = "crate", 0
    for j in range(1, len(segs) + 1):
        cand = "::".join(segs[:j])
        if cand in tgt.modules:
            best, k = cand, j
        else:
            break
    rest = segs[k:]
    if rest and seen < 8:
        alias = tgt.modules[best].reexports.get(rest[0])
        if alias:
            return resolve(tgt, alias.split("::") + rest[1:], seen + 1)
    return best


def edges(tgt: Target) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {p: set() for p in tgt.modules}
    for mod in tgt.modules.values():
        for segs, is_pub, pos in mod.uses:
            full = absolute(tgt, mod, segs, pos)
            if full is None:
                continue
            if is_pub and segs[-1] != "*":
                # a re-export aliases its target; the importer depends on the target instead
                continue
            dst = resolve(tgt, full)
            if dst and dst != mod.path and not contains(mod.path, dst):
                graph[mod.path].add(dst)
    return graph


def contains(parent: str, path: str) -> bool:
    """True when `path` is one of `parent`'s descendants (everything is the root's)."""
    return parent == "crate" or path.startswith(parent + "::")


def tarjan(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def targets_of(member: Path, include_tests: bool) -> list[Target]:
    manifest = tomllib.loads((member / "Cargo.toml").read_text(encoding="utf-8"))
    name = manifest["package"]["name"]
    found = []
    lib = member / manifest.get("lib", {}).get("path", "src/lib.rs")
    if lib.exists():
        found.append(("lib", lib))
    bins = {b["name"]: member / b.get("path", f"src/bin/{b['name']}.rs") for b in manifest.get("bin", [])}
    if (member / "src/main.rs").exists() and name not in bins:
        bins[name] = member / "src/main.rs"
    for f in sorted((member / "src/bin").glob("*.rs")) if (member / "src/bin").is_dir() else []:
        bins.setdefault(f.stem, f)
    for b, f in sorted(bins.items()):
        if f.exists():
            found.append((f"bin {b}", f))
    return [load_target(name, kind, f, include_tests) for kind, f in found]


def layer_violations(tgt: Target, graph: dict[str, set[str]]) -> list[str]:
    def under(path: str, top: str) -> bool:
        return path == top or path.startswith(top + "::")

    out = []
    for src, dsts in sorted(graph.items()):
        if under(src, API_MODULE) or any(under(src, e) for e in API_ENTRY_POINTS):
            continue
        for dst in sorted(dsts):
            if under(dst, API_MODULE):
                out.append(f"{src} -> {dst}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--include-tests", action="store_true", help="count unit-test modules too")
    ap.add_argument("--edges", action="store_true", help="print every module's imports")
    ap.add_argument("--root", type=Path, default=ROOT, help="the workspace (default: this one)")
    args = ap.parse_args()

    ws = tomllib.loads((args.root / "Cargo.toml").read_text(encoding="utf-8"))["workspace"]
    members = [
        m for pat in ws["members"] for m in sorted(args.root.glob(pat)) if (m / "Cargo.toml").exists()
    ]
    failed = False
    for member in members:
        for tgt in targets_of(member, args.include_tests):
            graph = edges(tgt)
            cycles = tarjan(graph)
            label = f"{tgt.crate} ({tgt.kind}, {len(tgt.modules)} modules)"
            if args.edges:
                for src in sorted(graph):
                    print(f"  {tgt.crate}: {src} -> {', '.join(sorted(graph[src])) or '-'}")
            violations = layer_violations(tgt, graph) if tgt.crate == LAYERED_CRATE else []
            if not cycles and not violations:
                print(f"ok   {label}: no circles" + (", no domain -> api imports" if tgt.crate == LAYERED_CRATE else ""))
                continue
            failed = True
            print(f"FAIL {label}")
            for comp in cycles:
                inner = {v: sorted(w for w in graph[v] if w in comp) for v in comp}
                print(f"  circle of {len(comp)}: {', '.join(comp)}")
                for v in comp:
                    print(f"    {v} -> {', '.join(inner[v])}")
            for v in violations:
                print(f"  domain module imports the API layer: {v}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
