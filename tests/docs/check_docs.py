#!/usr/bin/env python3
"""Checks the repository's Markdown: every relative link (README.md, docs/, bench/results/,
and every other tracked .md) names a file or folder inside the repository, and an anchor
names a heading of its file; README.md stays under 200 lines; README.md and docs/ never point
outside the repository (../shared); docs/README.md lists every document of docs/.

    check_docs.py REPO_ROOT        exit 0 when all hold, 1 with one line per problem
"""

import re
import subprocess
import sys
from pathlib import Path

LINK = re.compile(r"(?<!\\)\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
README_MAX_LINES = 200


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose(path):
    """The lines of a Markdown file outside fenced code blocks."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def anchors(path):
    found = set()
    for line in prose(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = 0
            while (base if n == 0 else f"{base}-{n}") in found:
                n += 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def main(root):
    root = root.resolve()
    files = subprocess.run(["git", "-C", str(root), "ls-files", "*.md"], check=True,
                           capture_output=True, text=True).stdout.split()
    # Documents written here but not committed yet are checked too.
    for extra in ["README.md", *[str(p.relative_to(root)) for p in (root / "docs").glob("*.md")],
                  *[str(p.relative_to(root)) for p in (root / "bench/results").rglob("*.md")]]:
        if extra not in files:
            files.append(extra)
    problems = []
    for name in files:
        path = root / name
        if not path.is_file() or "/corpus/" in name:
            continue
        for number, line in enumerate(prose(path), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                if root not in dest.parents and dest != root:
                    problems.append(f"{name}: link leaves the repository: {target}")
                    continue
                if not dest.exists():
                    problems.append(f"{name}: link to a missing file: {target}")
                    continue
                if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{name}: no heading '#{anchor}' in {dest.relative_to(root)}")
    readme = root / "README.md"
    lines = len(readme.read_text(encoding="utf-8").splitlines())
    if lines >= README_MAX_LINES:
        problems.append(f"README.md: {lines} lines (keep it under {README_MAX_LINES})")
    for path in [readme, *sorted((root / "docs").glob("*.md"))]:
        if "../shared" in path.read_text(encoding="utf-8"):
            problems.append(f"{path.relative_to(root)}: points at ../shared, outside the repository")
    index = (root / "docs/README.md").read_text(encoding="utf-8")
    for doc in sorted((root / "docs").glob("*.md")):
        if doc.name != "README.md" and f"]({doc.name}" not in index:
            problems.append(f"docs/README.md: does not list {doc.name}")
    for p in problems:
        print(p)
    print(f"checked {len(files)} Markdown files: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
