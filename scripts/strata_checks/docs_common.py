"""What check-docs' parts share: the tree's files, reading one, and folder membership."""
import os
import subprocess

C_EXTS = (".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh")
HEADER_EXTS = (".h", ".hpp", ".cuh")
NOT_LIBRARIES = ("tests", "bench", "examples", "scripts", "docs")
PARTS = ("readmes", "config", "links")


def repo_files(root):
    """Tracked files and new ones git does not ignore (or every file, outside git), relative."""
    if os.path.exists(os.path.join(root, ".git")):
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.split("\n")
        return sorted(p for p in out if p and os.path.isfile(os.path.join(root, p)))
    found = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "build"]
        found += [os.path.relpath(os.path.join(top, n), root) for n in names]
    return sorted(found)


def read(root, path):
    try:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return ""


def under(path, folder):
    return folder == "" or path == folder or path.startswith(folder + "/")
