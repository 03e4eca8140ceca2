#!/usr/bin/env bash
# Fails when a crate's modules import each other in a circle across more than three files
# (`crate::`, `super::` and `self::` paths, `#[cfg(test)]` code included; a module using its
# own parent's items does not count: that is the module tree). A circle shows
# which file should depend only downward; see docs/development.md ("Module layers").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 - "$@" <<'PY'
import os, re, sys

LIMIT = 3
crates = sorted(d for d in os.listdir(".") if os.path.isfile(os.path.join(d, "Cargo.toml")) and os.path.isdir(os.path.join(d, "src")))

def modules(src):
    """Module path (a tuple) of every .rs file under src."""
    found = {}
    for d, _, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                path = os.path.relpath(os.path.join(d, f), src)[:-3].split(os.sep)
                if path[-1] == "mod":
                    path = path[:-1]
                if path in (["lib"], ["main"]):
                    path = []
                found[tuple(path)] = os.path.join(d, f)
    return found

def use_paths(text, i):
    """The paths of the use tree (or plain path) starting at text[i:]."""
    paths = []
    def segment(i):
        m = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*|\*)", text[i:])
        return (m.group(1), i + m.end()) if m else (None, i)
    def tree(i, prefix):
        name, j = segment(i)
        while True:
            if name is None:
                m = re.match(r"\s*\{", text[i:])
                if not m:
                    return i
                i += m.end()
                while True:
                    i = tree(i, prefix)
                    m = re.match(r"\s*,", text[i:])
                    if m:
                        i += m.end()
                        continue
                    m = re.match(r"\s*\}", text[i:])
                    return i + m.end() if m else i
            prefix, i = prefix + [name], j
            m = re.match(r"\s*::", text[i:])
            if not m:
                paths.append(prefix)
                return i
            i += m.end()
            name, j = segment(i)
    tree(i, [])
    return paths

def graph(src):
    mods = modules(src)
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        text = re.sub(r"//[^\n]*", "", open(f, encoding="utf-8").read())
        for hit in re.finditer(r"\b(crate|super|self)::", text):
            # Inside an inline `mod x { … }` (tests), `super` is the file's own module.
            inline = re.search(r"\bmod\s+\w+\s*\{", text[: hit.start()]) is not None
            for path in use_paths(text, hit.end()):
                if hit.group(1) == "crate":
                    full = path
                elif hit.group(1) == "self":
                    full = list(m) + path
                else:
                    # `super` of a file's module is its parent (mod.rs included); inside an
                    # inline `mod x { … }` (tests) it is the file's own module.
                    base = list(m) if inline else list(m[:-1])
                    while path and path[0] == "super":
                        base, path = base[:-1], path[1:]
                    full = base + path
                for k in range(len(full), 0, -1):
                    target = tuple(full[:k])
                    if target in mods:
                        # A module using its own ancestors (their shared types) is the
                        # module tree, not a layer: only other modules count.
                        if target != m[: len(target)]:
                            edges[m].add(target)
                        break
    return edges

def circles(edges):
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)
    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)
    for v in edges:
        if v not in index:
            visit(v)
    return found

failed = False
name = lambda m: "::".join(m) or "crate root"
for crate in crates:
    edges = graph(os.path.join(crate, "src"))
    for component in circles(edges):
        if len(component) > LIMIT:
            failed = True
            members = set(component)
            print(f"{crate}: an import circle across {len(component)} files:", file=sys.stderr)
            for v in sorted(component):
                print(f"  {name(v)} -> {', '.join(sorted(name(w) for w in edges[v] if w in members))}", file=sys.stderr)
sys.exit(1 if failed else 0)
PY
