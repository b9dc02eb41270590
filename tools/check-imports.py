#!/usr/bin/env python3
"""Checks the module layering of src/: no import circles, no back-arrows.

Reads every `crate::`, `super::` and `self::` path in src/ (the library) and
src/bin/<name>/ (each binary its own crate) and resolves it to the file
(module) it names. Then:
  - between the top-level modules of a crate (src/engine/, src/ggml/, ...):
    the graph of imports must have no cycle;
  - between the files of one folder (src/engine/pager.rs, src/engine/store.rs,
    ...): no cycle either;
  - no back-arrow: a file never imports from the root (mod.rs) of a folder
    it lives in; the root imports its parts, parts import siblings or lower
    modules, never the root.
Tests (`#[cfg(test)] mod ... { }` blocks and tests/) are not counted: a
test may reach anywhere. Prints the layering it found (lowest first), each
violation with a file and line, and exits 1 on any violation.

  tools/check-imports.py [--graph]     (--graph: print every edge too)
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PATH_RE = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
USE_RE = re.compile(r"\buse\s+([^;]*);", re.S)


def expand_use(tree):
    """Every full path of a use tree: `a::{b, c::{d, e}}` -> a::b, a::c::d, a::c::e."""
    tree = re.sub(r"\s+", "", tree)
    i = tree.find("{")
    if i < 0:
        return [re.sub(r"as\w+$", "", tree.split(" as ")[0])] if tree else []
    prefix = tree[:i]
    depth, parts, start = 0, [], i + 1
    for j in range(i, len(tree)):
        if tree[j] == "{":
            depth += 1
        elif tree[j] == "}":
            depth -= 1
            if depth == 0:
                parts.append(tree[start:j])
                break
        elif tree[j] == "," and depth == 1:
            parts.append(tree[start:j])
            start = j + 1
    out = []
    for part in parts:
        for sub in expand_use(part):
            if sub == "self":
                out.append(prefix.rstrip(":"))
            elif sub:
                out.append(prefix + sub)
    return out


def strip_comments_and_strings(text):
    """Blanks comments, strings and char literals, keeping line breaks."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or c == "'" and re.match(r"'\\(x..|u\{[0-9a-fA-F]+\})'", text[i:i + 12]):
            m = re.match(r"'(\\(x..|u\{[0-9a-fA-F]+\}|.)|[^\\'])'", text[i:])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Crate:
    def __init__(self, name, root_dir, root_file):
        self.name = name
        self.root_dir = root_dir  # folder holding the crate root file
        self.root_file = root_file  # lib.rs or main.rs
        self.files = {}  # module path tuple -> file path

    def scan(self):
        """Finds every module file reachable from the root."""
        self._scan((), self.root_file)

    def _scan(self, mpath, fpath):
        self.files[mpath] = fpath
        text = strip_comments_and_strings(open(fpath).read())
        base = self.dir_of(mpath, fpath)
        for m in re.finditer(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text, re.M):
            name = m.group(1)
            for cand in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
                if os.path.exists(cand):
                    self._scan(mpath + (name,), cand)
                    break

    def dir_of(self, mpath, fpath):
        """The folder a module's child files live in."""
        if fpath == self.root_file or os.path.basename(fpath) == "mod.rs":
            return os.path.dirname(fpath)
        return os.path.splitext(fpath)[0]

    def resolve(self, segs):
        """The longest known module prefix of an absolute path."""
        segs = tuple(segs)
        for k in range(len(segs), -1, -1):
            if segs[:k] in self.files:
                return segs[:k]
        return ()


def file_uses(crate, mpath, fpath):
    """(line, target module path) for every crate-relative path in a file,
    outside test blocks."""
    text = strip_comments_and_strings(open(fpath).read())
    lines = text.split("\n")
    # each use statement, keyed by the line it starts on
    use_text = {}
    for um in USE_RE.finditer(text):
        if "{" in um.group(1):
            use_text.setdefault(text.count("\n", 0, um.start()) + 1, "")
            use_text[text.count("\n", 0, um.start()) + 1] += um.group(0) + " "
    uses = []
    # inline modules: a stack of (name, depth at which it closes, is_test)
    stack = []
    depth = 0
    pending_test = False
    for lineno, line in enumerate(lines, 1):
        if re.search(r"#\[cfg\((all\()?test", line):
            pending_test = True
        m = re.match(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*\{", line)
        in_test = any(t for _, _, t in stack)
        if not in_test:
            cur = mpath + tuple(n for n, _, _ in stack)
            found = [(pm.group(1), pm.group(2)) for pm in PATH_RE.finditer(line)]
            # use trees with braces, which the pattern above sees only in part
            for um in USE_RE.finditer(use_text.get(lineno, "")):
                for path in expand_use(um.group(1)):
                    head, _, tail = path.partition("::")
                    if head in ("crate", "super", "self") and tail:
                        found.append((head, "::" + tail))
            for kind, rest in found:
                segs = [s for s in rest.split("::") if s]
                if kind == "crate":
                    absp = segs
                elif kind == "self":
                    absp = list(cur) + segs
                else:
                    up = list(cur)
                    rest = segs
                    up = up[:-1] if up else up
                    while rest and rest[0] == "super":
                        up = up[:-1] if up else up
                        rest = rest[1:]
                    absp = up + rest
                uses.append((lineno, crate.resolve(absp), absp))
        if m:
            stack.append((m.group(1), depth, pending_test))
            pending_test = False
        elif re.match(r"^\s*(fn|impl|struct|enum|use|const|static|pub)\b", line):
            pending_test = False
        for ch in line:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                # an inline module closes when depth returns to its opening depth
                while stack and depth == stack[-1][1]:
                    stack.pop()
    return uses


def find_cycles(nodes, edges):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, on, st, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        st.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = st.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def levels(nodes, edges):
    """Longest-path level of each node (0: imports nothing here)."""
    memo = {}

    def lvl(v, seen=()):
        if v in memo:
            return memo[v]
        if v in seen:
            return 0
        deps = [w for w in edges.get(v, ()) if w != v]
        memo[v] = 1 + max((lvl(w, seen + (v,)) for w in deps), default=-1)
        return memo[v]

    return {v: lvl(v) for v in nodes}


def check(crate, show_graph):
    crate.scan()
    bad = []
    top_edges = {}  # top module -> set of top modules
    folder_edges = {}  # folder path -> {child -> set(child)}
    where = {}
    for mpath, fpath in sorted(crate.files.items()):
        rel = os.path.relpath(fpath, ROOT)
        for lineno, target, absp in file_uses(crate, mpath, fpath):
            if not target and absp and absp[0] in ("sys",):
                continue
            # back-arrow: a file importing the root of a folder it is in
            if target and len(target) < len(mpath) and mpath[:len(target)] == target:
                bad.append(f"{rel}:{lineno}: back-arrow: {'::'.join(mpath)} imports from the root of {'::'.join(target) or 'the crate'} ({'::'.join(absp)})")
            # edges between top-level modules
            if mpath and target and mpath[0] != target[0]:
                top_edges.setdefault(mpath[0], set()).add(target[0])
                where.setdefault((mpath[0], target[0]), f"{rel}:{lineno}")
            # edges between siblings of one folder
            k = 0
            while k < min(len(mpath), len(target)) and mpath[k] == target[k]:
                k += 1
            if k < len(mpath) and k < len(target):
                folder = mpath[:k]
                a, b = mpath[k], target[k]
                folder_edges.setdefault(folder, {}).setdefault(a, set()).add(b)
                where.setdefault((folder, a, b), f"{rel}:{lineno}")
    tops = {m[0] for m in crate.files if m}
    for comp in find_cycles(tops, top_edges):
        cyc = ", ".join(f"{a}->{b} ({where[(a, b)]})" for a in comp for b in sorted(top_edges.get(a, ())) if b in comp)
        bad.append(f"import circle between modules of {crate.name}: {cyc}")
    for folder, edges in sorted(folder_edges.items()):
        if not folder:
            continue  # the crate's top level: checked above
        kids = set(edges) | {b for s in edges.values() for b in s}
        for comp in find_cycles(kids, edges):
            cyc = ", ".join(f"{a}->{b} ({where[(folder, a, b)]})" for a in comp for b in sorted(edges.get(a, ())) if b in comp)
            bad.append(f"import circle inside {'::'.join(folder) or crate.name}: {cyc}")
    lv = levels(tops, top_edges)
    print(f"{crate.name}: layers, lowest first:")
    for l in range(max(lv.values(), default=-1) + 1):
        print(f"  {l}: {' '.join(sorted(m for m in tops if lv[m] == l))}")
    if show_graph:
        for a in sorted(top_edges):
            print(f"  {a} -> {' '.join(sorted(top_edges[a]))}")
    return bad


def main():
    show = "--graph" in sys.argv
    crates = [Crate("lib", os.path.join(ROOT, "src"), os.path.join(ROOT, "src", "lib.rs"))]
    bindir = os.path.join(ROOT, "src", "bin")
    for name in sorted(os.listdir(bindir)) if os.path.isdir(bindir) else []:
        main_rs = os.path.join(bindir, name, "main.rs")
        if os.path.exists(main_rs):
            crates.append(Crate(f"bin {name}", os.path.dirname(main_rs), main_rs))
    bad = []
    for c in crates:
        bad += check(c, show)
    for b in bad:
        print(b)
    print(f"check-imports: {len(bad)} problem(s)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
