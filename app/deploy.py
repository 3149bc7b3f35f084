"""Create or update a Hugging Face Space from this checkout, with what the Space needs and nothing else.

    python -m app.deploy USER/SPACE --dry-run     # list the files, their sizes and how each is stored; upload nothing
    python -m app.deploy USER/SPACE               # create the Space if needed, then one commit: the file set, and
                                                  # the removal of any file the Space holds outside it
    python -m app.deploy USER/SPACE --private     # a new Space is private

The file set (`space_files`) is the git-tracked files under `INCLUDE` less `EXCLUDE`: the README (whose front
matter makes the folder a Gradio Space), requirements.txt, `.gitattributes`, `app/`, `hap/`, `analysis/` without the
small model's training code, `assets/` (the shipped model and examples) and `docs/` (the README's figures); never
`.venv`, `results/`, `tests/` or CI files. The Hub refuses a binary file over 1 MB, and any file over 10 MB, that is
not in its large-file storage: `check_hub_rules` checks the set against those rules and against `.gitattributes`,
whose LFS patterns route every binary type shipped here through large-file storage (for an upload here, and for
those who push the same files with git and git-lfs). The upload itself is `HfApi.create_commit`, which sends each
file the Hub marks for large-file storage through it. It needs a token with write access (`hf auth login`, or
HF_TOKEN).
"""

from __future__ import annotations

import argparse
import fnmatch
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ("README.md", "requirements.txt", ".gitattributes", "app/*", "hap/*", "analysis/*", "assets/*", "docs/*")
EXCLUDE = ("analysis/training/*", "app/gpu_check.py")  # training research and the GPU check: not the Space's
BINARY_LIMIT = 1_000_000  # bytes: a larger binary file must be in large-file storage
FILE_LIMIT = 10_000_000  # bytes: any larger file must be in large-file storage


@dataclass(frozen=True)
class SpaceFile:
    path: str  # relative to the checkout, with forward slashes
    size: int  # bytes
    binary: bool  # a NUL byte in the first 8,000 bytes, git's own test
    lfs: bool  # matched by an LFS pattern of .gitattributes


def tracked_files(root: Path = ROOT) -> list[str]:
    """The files git tracks in `root`, as they are in the work tree (a deleted one is left out)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"app.deploy needs a git checkout with git on PATH (the file set is git's tracked files): {e}")
    return [p for p in out.decode().split("\0") if p and (root / p).is_file()]


def lfs_patterns(root: Path = ROOT) -> list[str]:
    """The patterns `.gitattributes` sends through git-lfs (`filter=lfs`)."""
    path = root / ".gitattributes"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [line.split()[0] for line in lines if "filter=lfs" in line.split()[1:]]


def _in(path: str, patterns) -> bool:
    """Whether `path` (from the checkout's root) matches one of `patterns` (`*` crosses folders)."""
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def _lfs(path: str, patterns) -> bool:
    """git's rule for an attribute pattern: without a slash it matches the file name in any folder."""
    return any(fnmatch.fnmatchcase(path if "/" in p else path.rsplit("/", 1)[-1], p) for p in patterns)


def is_binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(8000)


def space_files(root: Path = ROOT) -> list[SpaceFile]:
    """The Space's file set, sorted by path."""
    lfs = lfs_patterns(root)
    paths = [p for p in tracked_files(root) if _in(p, INCLUDE) and not _in(p, EXCLUDE)]
    return [SpaceFile(p, (root / p).stat().st_size, is_binary(root / p), _lfs(p, lfs)) for p in sorted(paths)]


def check_hub_rules(files: list[SpaceFile]) -> list[str]:
    """What the Hub would refuse, one line a file (empty: nothing): a binary file over `BINARY_LIMIT` or any file
    over `FILE_LIMIT` outside large-file storage."""
    problems = []
    for f in files:
        if not f.lfs and (f.size > FILE_LIMIT or (f.binary and f.size > BINARY_LIMIT)):
            kind = "file" if f.size > FILE_LIMIT else "binary file"
            problems.append(f"{f.path}: a {kind} of {f.size:,} bytes outside large-file storage (add its pattern "
                            "with filter=lfs to .gitattributes)")
    return problems


def listing(files: list[SpaceFile]) -> str:
    """The dry run's table: each file's size and storage, then the totals."""
    rows = [f"{f.size:>12,}  {'lfs' if f.lfs else 'git'}  {f.path}" for f in files]
    lfs = sum(f.size for f in files if f.lfs)
    total = sum(f.size for f in files)
    return "\n".join([*rows, f"{len(files)} files, {total:,} bytes ({lfs:,} in large-file storage)"])


def publish(api, space_id: str, files: list[SpaceFile], root: Path = ROOT, private: bool = False) -> str:
    """Create the Space if it does not exist, then one commit that adds `files` and deletes every other file the
    Space holds; returns the commit's URL. `api` is a `huggingface_hub.HfApi`."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    api.create_repo(space_id, repo_type="space", space_sdk="gradio", private=private, exist_ok=True)
    keep = {f.path for f in files}
    stale = [p for p in api.list_repo_files(space_id, repo_type="space") if p not in keep]
    operations = [CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(root / f.path)) for f in files]
    operations += [CommitOperationDelete(path_in_repo=p) for p in stale]
    info = api.create_commit(space_id, operations, repo_type="space",
                             commit_message="Deploy HAP from its checkout (python -m app.deploy)")
    return info.commit_url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("space_id", metavar="USER/SPACE", help="the Space to create or update")
    p.add_argument("--dry-run", action="store_true", help="list the files, sizes and storage; upload nothing")
    p.add_argument("--private", action="store_true", help="make a new Space private")
    args = p.parse_args(argv)
    if args.space_id.count("/") != 1 or not all(args.space_id.split("/")):
        p.error(f"USER/SPACE must be an owner and a name joined by one '/', got {args.space_id!r}")
    files = space_files()
    print(listing(files))
    problems = check_hub_rules(files)
    if problems:
        print("The Hub would refuse:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    if args.dry_run:
        return 0
    from huggingface_hub import HfApi

    print(publish(HfApi(), args.space_id, files, private=args.private))
    return 0


if __name__ == "__main__":
    sys.exit(main())
