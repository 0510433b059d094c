"""`--verify-integrity`: a SHA-256 manifest of a torch_dist checkpoint's files.

Saving writes `integrity.json` into the checkpoint directory once every rank's files are
complete and before the directory is renamed into place, so a checkpoint that looks whole has
its manifest. It maps each file's path (relative to the checkpoint directory) to its SHA-256
and size. Loading hashes the files again and compares: a missing, changed or extra file, or a
missing manifest, is a problem reported in one line. Rank 0 hashes and tells the others its
verdict, so every rank agrees (and a shared filesystem is read once).
"""

import hashlib
import json
import os

import torch
import torch.distributed as dist

from megatron.common.errors import UserError

MANIFEST = "integrity.json"
ALGORITHM = "sha256"
_CHUNK = 1 << 20  # bytes hashed per read: bounded memory whatever the file size


def file_digest(path: str) -> dict:
    """{"sha256": hex digest, "size": bytes} of one file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {ALGORITHM: digest.hexdigest(), "size": size}


def checkpoint_files(directory: str) -> list[str]:
    """Relative paths of every file under `directory`, the manifest excepted, sorted."""
    found = []
    for parent, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(parent, name), directory)
            if relative != MANIFEST:
                found.append(relative)
    return sorted(found)


def write_manifest(directory: str) -> None:
    """Hash every file of `directory` into its manifest, written under a temporary name and
    renamed so that a manifest is never half written."""
    files = {
        name: file_digest(os.path.join(directory, name)) for name in checkpoint_files(directory)
    }
    path = os.path.join(directory, MANIFEST)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as handle:
        json.dump({"algorithm": ALGORITHM, "files": files}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _read_manifest(directory: str) -> tuple[dict | None, str | None]:
    """(relative path -> digest, None) or (None, the problem)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None, f"no {MANIFEST} (saved without --verify-integrity?)"
    try:
        with open(path) as handle:
            manifest = json.load(handle)
        files = manifest["files"]
        algorithm = manifest["algorithm"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"{MANIFEST} is unreadable ({type(error).__name__}: {error})"
    if algorithm != ALGORITHM or not isinstance(files, dict):
        return None, f"{MANIFEST} is not a {ALGORITHM} manifest"
    return files, None


def manifest_problem(directory: str) -> str | None:
    """None if every file of `directory` matches its manifest, else the first difference."""
    expected, problem = _read_manifest(directory)
    if problem is not None:
        return problem
    on_disk = checkpoint_files(directory) if os.path.isdir(directory) else []
    for name in sorted(expected):
        if name not in on_disk:
            return f"{name} is missing"
    for name in on_disk:
        if name not in expected:
            return f"{name} is not in {MANIFEST} (an extra file)"
    for name in on_disk:
        recorded, actual = expected[name], file_digest(os.path.join(directory, name))
        if actual != recorded:
            return (
                f"{name} changed ({ALGORITHM} {actual[ALGORITHM][:16]}..., {actual['size']} "
                f"bytes; {MANIFEST} has {str(recorded.get(ALGORITHM))[:16]}..., "
                f"{recorded.get('size')} bytes)"
            )
    return None


def integrity_problem(directory: str, device: torch.device, required: bool = True) -> str | None:
    """The verdict of rank 0 on `directory`, on every rank (collective). Not `required`: a
    checkpoint without a manifest passes (one saved without --verify-integrity), one with a
    manifest is checked against it."""
    verdict = [None]
    present = os.path.isfile(os.path.join(directory, MANIFEST))
    if dist.get_rank() == 0 and (required or present):
        problem = manifest_problem(directory)
        verdict = [
            f"checkpoint {directory} failed its integrity check: {problem}" if problem else None
        ]
    dist.broadcast_object_list(verdict, src=0, device=device)
    return verdict[0]
