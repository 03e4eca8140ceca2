#!/usr/bin/env bash
# Fails when a relative link in a Markdown file of the repository points at a file that does
# not exist, or at a heading (#anchor) that file does not have (GitHub's heading anchors:
# lower case, punctuation dropped, spaces to hyphens, repeats numbered -1, -2, …).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 - <<'PY'
import os, re, subprocess, sys

files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.md"],
                       capture_output=True, text=True, check=True).stdout.split()
files = [f for f in files if os.path.exists(f) and not f.startswith("testdata/")]

def anchors(path):
    found, seen, fence = set(), {}, False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"`|\*|_{2,}", "", m.group(2))
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
        slug = re.sub(r"[^\w\- ]", "", text.lower(), flags=re.UNICODE).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found

link = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
errors = []
cache = {}
for f in files:
    fence = False
    for number, line in enumerate(open(f, encoding="utf-8"), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        for target in link.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
            if not os.path.exists(resolved):
                errors.append(f"{f}:{number}: {target}: no such file")
                continue
            if anchor and resolved.endswith(".md"):
                if resolved not in cache:
                    cache[resolved] = anchors(resolved)
                if anchor not in cache[resolved]:
                    errors.append(f"{f}:{number}: {target}: no heading #{anchor} in {resolved}")
for e in errors:
    print(e, file=sys.stderr)
if errors:
    sys.exit(f"check-docs: {len(errors)} broken link(s)")
print(f"check-docs: OK ({len(files)} files)")
PY
