"""check-docs: runs the chosen parts over a tree and words the one-line summary."""
from .docs_common import repo_files
from .docs_config import check_config
from .docs_links import check_links
from .docs_readmes import check_readmes


def run(root, parts):
    """(failures, summary)."""
    files = repo_files(root)
    failures, counts = [], {}
    if "links" in parts:
        found, counts["links"] = check_links(root, files)
        failures += found
    if "readmes" in parts:
        found, *counts["readmes"] = check_readmes(root, files)
        failures += found
    if "config" in parts:
        found, *counts["config"] = check_config(root, files)
        failures += found
    summary = []
    if "links" in counts:
        summary.append(f"{counts['links']} links")
    if "readmes" in counts:
        summary.append("{} folder READMEs ({} callers, {} may-call edges)".format(*counts["readmes"]))
    if "config" in counts:
        summary.append("{} config keys ({} defaults)".format(*counts["config"]))
    return failures, "check-docs: " + ", ".join(summary) + ": ok"
