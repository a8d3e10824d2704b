"""check-docs links: relative links (and backticked Markdown paths) in README.md and docs/
name files inside the repository, and anchors name headings."""
import os
import re

from .docs_common import read

LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|"
                  r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_MD = re.compile(r"`([^`\s]+\.md(?:#[^`\s]*)?)`")
ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def slug(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def prose_lines(text):
    """(line number, line, line with inline code blanked) outside fenced code."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        yield n, line, re.sub(r"(`+)(?:(?!\1).)+?\1", lambda c: " " * len(c.group(0)), line)


def anchors(text):
    seen, out = {}, set()
    for _, _, line in prose_lines(text):
        for a in ANCHOR.findall(line):
            out.add(a)
    fence = None
    for line in text.split("\n"):
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if fence or m:
            fence = None if fence and m and m.group(1)[0] == fence[0] else (fence or m.group(1))
            continue
        h = HEADING.match(line)
        if h:
            s = slug(h.group(2))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def check_links(root, files):
    docs = [f for f in files if f == "README.md" or (f.startswith("docs/") and f.endswith(".md"))]
    real_root = os.path.realpath(root)
    failures, count = [], 0
    for doc in docs:
        text = read(root, doc)
        for n, raw, line in prose_lines(text):
            targets = [(m.group(1) or m.group(2), False) for m in LINK.finditer(line)]
            r = REFDEF.match(line)
            if r:
                targets.append((r.group(1), False))
            targets += [(t, True) for t in CODE_MD.findall(raw)]
            for target, quoted in targets:
                count += 1
                where = f"{doc}:{n}"
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                    if not re.match(r"^(https?|mailto):", target, re.I):
                        failures.append((where, f"link `{target}`: only http(s), mailto and relative links"))
                    continue
                path, _, anchor = target.partition("#")
                path = path.split("?")[0]
                resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
                if quoted and not os.path.exists(os.path.join(root, resolved)):
                    resolved = os.path.normpath(path)  # prose names files from the root
                full = os.path.realpath(os.path.join(root, resolved))
                if resolved.startswith("..") or os.path.isabs(path) or not (
                        full == real_root or full.startswith(real_root + os.sep)):
                    failures.append((where, f"link `{target}` leaves the repository; link a file inside it"))
                    continue
                if not os.path.exists(full):
                    hint = (" (a Markdown file named in backticks counts as a link; another project's file "
                            "goes without backticks or as an http link)" if quoted else "")
                    failures.append((where, f"link `{target}`: no file {resolved}{hint}"))
                    continue
                if anchor and resolved.endswith(".md") and os.path.isfile(full):
                    if anchor not in anchors(read(root, resolved)):
                        failures.append((where, f"link `{target}`: {resolved} has no heading whose anchor is "
                                                f"#{anchor}"))
    return failures, count
