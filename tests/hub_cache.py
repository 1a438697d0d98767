"""A Hugging Face Hub cache laid out here, for the tests that resolve a Hub id offline (HF_HUB_OFFLINE=1)."""

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(hf_home: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Lay `source`'s files out as huggingface_hub caches them: blobs/, snapshots/<commit>/ links, refs/main."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / f.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / "main").write_text(commit)
    return snapshot
