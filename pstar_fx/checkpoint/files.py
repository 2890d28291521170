"""The files of a checkpoint directory: the manifest that marks it, the checksums that guard it, and how a save
lives on disk (a fresh sibling directory, published by rename; what killed saves left beside it, removed later).

The manifest. Every pstar-fx checkpoint directory holds one JSON manifest, written after every other file of it: it
says which format the directory is ("plain" or "sharded") and lists each of its other files with its size and
checksums. It is what makes a directory a pstar-fx checkpoint: `load` reads it first and checks every file against
it before reading anything out of them, and `save` replaces only a directory that holds one (and nothing it does
not list). It carries a checksum of its own, so a flipped bit in it is found too. Its file:
- plain files: `manifest.json`, beside model.pt, optimizer.pt and meta.pt;
- sharded: `.metadata`, the name torch.distributed.checkpoint gives its metadata file, which holds the manifest and
  DCP's metadata as JSON (pstar_fx.checkpoint.dcp_storage), not a pickle. torch's own DCP reader therefore does not
  read it, and pstar-fx never unpickles a `.metadata`, whoever wrote it.

Checksums: CRC-32 (zlib.crc32) of each 64 MiB block of a file, blocks on up to 8 threads (zlib releases the GIL).
Why CRC-32: it is the fastest check in the standard library (with adler32, which detects less). Measured on the
2-core test machine: zlib.crc32 over memory 2.4 GB/s per core (adler32 2.3, sha1 1.3, sha256 1.2, blake2b 0.6, md5
0.5); `checksum` over a 1 GiB file in the page cache 2.0-2.7 GB/s, so a 30 GB checkpoint costs about 12 s to check
here (each block on its own thread: less on a many-core host, where reading the disk is the limit). A save reads
back what it wrote to checksum it (the page cache holds it); a load checks before it reads. With the sizes, the
checksums detect accidental corruption: every single-bit flip, every burst of up to 32 flipped bits in a block, a
truncation, a torn copy. They are no defence against a deliberate forger, who can rewrite the manifest's checksums
too; what keeps a forged checkpoint from running code is that pstar-fx unpickles nothing beyond
`torch.load(weights_only=True)` and JSON.
"""
from __future__ import annotations

import dataclasses
import enum
import errno
import json
import os
import re
import shutil
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError

FORMAT_NAME = "pstar-fx checkpoint"
VERSION = 1
PLAIN_MANIFEST = "manifest.json"
SHARDED_MANIFEST = ".metadata"          # DCP's metadata file name: the sharded directory holds DCP's files only
DATA_FILES = ("model.pt", "optimizer.pt", "meta.pt")
BLOCK = 64 << 20                       # bytes per checksum
_READ = 4 << 20                        # bytes per read while checksumming (a reused buffer: no page faults)
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")
_ASIDE = re.compile(r"\.(tmp|old)-[0-9a-f]{8}")
_HEAD = re.compile(rb'\{"crc32":"([0-9a-f]{8})","manifest":')


class Kind(enum.Enum):
    PLAIN = "plain"
    SHARDED = "sharded"


MANIFEST_OF = {Kind.PLAIN: PLAIN_MANIFEST, Kind.SHARDED: SHARDED_MANIFEST}


@dataclasses.dataclass(frozen=True)
class FileSum:
    """A file's size and the CRC-32 of each BLOCK-byte block of it, in order."""
    size: int
    crc32: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a manifest says: the format, the checkpoint's other files with their checksums, and (sharded) DCP's
    metadata."""
    kind: Kind
    files: dict[str, FileSum]          # every other file of the checkpoint, by name
    dcp: dict | None = None            # sharded: DCP's metadata as JSON (pstar_fx.checkpoint.dcp_storage)


# -- checksums -------------------------------------------------------------------------------------------------------
def _block_crc(fd: int, start: int, stop: int) -> int:
    buf = memoryview(bytearray(min(_READ, stop - start)))
    crc, at = 0, start
    while at < stop:
        n = os.preadv(fd, [buf[:min(_READ, stop - at)]], at)
        if n == 0:
            raise OSError(errno.EIO, "the file shrank while it was read")
        crc = zlib.crc32(buf[:n], crc)
        at += n
    return crc


def _threads(blocks: int) -> int:
    return max(1, min(blocks, os.cpu_count() or 1, 8))


def checksum(file: str) -> FileSum:
    """The size and per-block CRC-32 of a file."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        starts = range(0, size, BLOCK)
        with ThreadPoolExecutor(_threads(len(starts))) as pool:
            crcs = pool.map(lambda a: _block_crc(f.fileno(), a, min(a + BLOCK, size)), starts)
            return FileSum(size, tuple(crcs))


def verify(directory: str, name: str, want: FileSum) -> None:
    """Raise, naming the file and the cause, unless it is there with the size and checksums the manifest gives."""
    file = os.path.join(directory, name)
    try:
        size = os.stat(file).st_size
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"step.load: {file} is missing (the checkpoint's manifest lists it): "
                                "the checkpoint is incomplete", file) from None
    except OSError as e:
        raise described(e, file, "step.load: reading") from e
    if size < want.size:
        raise CheckpointError(f"step.load: {file} is truncated: {size} of its {want.size} bytes are there")
    if size > want.size:
        raise CheckpointError(f"step.load: {file} is corrupted: it has {size} bytes, its manifest says {want.size}")
    try:
        have = checksum(file)
    except OSError as e:
        raise described(e, file, "step.load: reading") from e
    bad = [i for i, (a, b) in enumerate(zip(have.crc32, want.crc32)) if a != b]
    if have.size != want.size or len(have.crc32) != len(want.crc32) or bad:
        at = bad[0] * BLOCK if bad else 0
        raise CheckpointError(f"step.load: {file} is corrupted: bytes [{at}, {min(at + BLOCK, size)}) do not match "
                              "their checksum in the manifest")


# -- the manifest ----------------------------------------------------------------------------------------------------
def write_manifest(directory: str, manifest: Manifest) -> None:
    """Write (and fsync) the manifest: `{"crc32": "<hex>", "manifest": <body>}`, the CRC-32 of the body's bytes."""
    body = {"format": FORMAT_NAME, "version": VERSION, "kind": manifest.kind.value, "block_bytes": BLOCK,
            "files": {n: {"bytes": s.size, "crc32": list(s.crc32)} for n, s in sorted(manifest.files.items())}}
    if manifest.dcp is not None:
        body["dcp"] = manifest.dcp
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    data = b'{"crc32":"%08x","manifest":' % zlib.crc32(raw) + raw + b"}\n"
    file = os.path.join(directory, MANIFEST_OF[manifest.kind])
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _parse(data: bytes) -> dict | None:
    """The manifest body if `data` is a pstar-fx manifest whose checksum holds, else None."""
    head = _HEAD.match(data)
    if head is None or not data.endswith(b"}\n"):
        return None
    raw = data[head.end():-2]
    if zlib.crc32(raw) != int(head.group(1), 16):
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) and body.get("format") == FORMAT_NAME else None


def _looks_like_manifest(data: bytes) -> bool:
    """Whether a file that fails to parse was meant to be a manifest (JSON, or naming the format; a pickle, DCP's
    own metadata, starts with 0x80): one flipped bit cannot change both."""
    return data[:1] == b"{" or FORMAT_NAME.encode() in data


def read_manifest(directory: str, name: str) -> Manifest:
    """The manifest in `directory/name`, checked (its own checksum, its structure) before anything it says is used."""
    file = os.path.join(directory, name)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise described(e, file, "step.load: reading") from e
    body = _parse(data)
    if body is None:
        if not data:
            raise CheckpointError(f"step.load: {file} is empty: the manifest is truncated")
        if _looks_like_manifest(data):
            raise CheckpointError(f"step.load: {file} is corrupted: the manifest does not match its own checksum "
                                  f"({len(data)} bytes)")
        if name == SHARDED_MANIFEST and data[:1] == b"\x80":
            raise CheckpointError(
                f"step.load: {file} is a pickle, not a pstar-fx manifest: the directory is a torch.distributed."
                "checkpoint written by torch itself or by a pstar-fx without manifests. Unpickling can run code, "
                "so pstar-fx does not read it")
        raise CheckpointError(f"step.load: {file} is not a pstar-fx manifest (it is not the JSON a save writes)")
    try:
        return _manifest(body, name)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"step.load: {file} is a pstar-fx manifest this version cannot read: {e}") from None


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _manifest(body: dict, name: str) -> Manifest:
    if body["version"] != VERSION:
        raise ValueError(f"manifest version {body['version']!r}, this pstar-fx reads version {VERSION}")
    kind = Kind(body["kind"])
    if MANIFEST_OF[kind] != name:
        raise ValueError(f"a {kind.value} checkpoint's manifest is {MANIFEST_OF[kind]}, not {name}")
    if body["block_bytes"] != BLOCK:
        raise ValueError(f"checksums of {body['block_bytes']!r}-byte blocks, this pstar-fx uses {BLOCK}")
    files = {}
    for n, s in body["files"].items():
        allowed = n in DATA_FILES if kind is Kind.PLAIN else _SHARD_FILE.fullmatch(n) is not None
        if not allowed:
            raise ValueError(f"the file name {n!r} is not one a {kind.value} checkpoint has")
        size, crcs = s["bytes"], s["crc32"]
        if not _int(size) or not isinstance(crcs, list) or len(crcs) != -(-size // BLOCK) \
                or not all(_int(c) and c < 2 ** 32 for c in crcs):
            raise ValueError(f"the entry of {n!r} is malformed")
        files[n] = FileSum(size, tuple(crcs))
    if kind is Kind.PLAIN and set(files) != set(DATA_FILES):
        raise ValueError(f"a plain checkpoint has the files {list(DATA_FILES)}, this manifest lists {sorted(files)}")
    dcp = body.get("dcp")
    if (kind is Kind.SHARDED) != isinstance(dcp, dict):
        raise ValueError("only a sharded checkpoint's manifest has DCP's metadata, and it must have it")
    return Manifest(kind, files, dcp)


def _aside(path: str) -> list[str]:
    """Siblings an interrupted save may have left: `<path>.tmp-*` and `<path>.old-*`."""
    parent, base = os.path.split(os.path.abspath(path))
    if not os.path.isdir(parent):
        return []
    return sorted(n for n in os.listdir(parent) if n.startswith(base) and _ASIDE.fullmatch(n[len(base):]))


def locate(path: str) -> Manifest:
    """The manifest of the checkpoint directory `path`, read and checked; raises, saying why, where there is none."""
    plain, sharded = os.path.join(path, PLAIN_MANIFEST), os.path.join(path, SHARDED_MANIFEST)
    if os.path.isfile(plain):            # a stray .metadata beside it does not make it sharded
        return read_manifest(path, PLAIN_MANIFEST)
    if os.path.isfile(sharded):
        return read_manifest(path, SHARDED_MANIFEST)
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, n)) for n in DATA_FILES):
        raise CheckpointError(
            f"step.load: {path!r} has no {PLAIN_MANIFEST}: it was not written by this pstar-fx (an older one wrote "
            "checkpoints without manifests, which are not loaded since nothing verifies them). Its .pt files load "
            "with torch.load(f, weights_only=True): pass model.pt to step.load_state_dict and optimizer.pt to "
            "step.optimizer.load_state_dict, then step.save a new checkpoint")
    try:
        target = save_target(path)       # a save through a symbolic link works beside the link's target
    except (OSError, ValueError):
        target = path
    aside = _aside(target)
    beside = "it" if target == path else f"the link's target {target!r}"
    hint = (f"; an interrupted save left {aside} beside {beside}: '.old-*' is the previous checkpoint, a '.tmp-*' "
            f"that holds a manifest the new one; rename the one you want to {os.path.basename(target)!r}"
            ) if aside else ""
    raise FileNotFoundError(errno.ENOENT, f"step.load: {path!r} is not a pstar-fx checkpoint (it has neither "
                            f"{PLAIN_MANIFEST} nor a sharded checkpoint's {SHARDED_MANIFEST})" + hint, path)


def verify_files(path: str, manifest: Manifest, share: tuple[int, int] = (0, 1)) -> None:
    """Check every file the manifest lists: that each is there, in full (cheap, all of them), and, for this rank's
    share (every world-th file from the rank-th, in name order), its checksums."""
    names = sorted(manifest.files)
    for name in names:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(errno.ENOENT, f"step.load: {file} is missing (the checkpoint's manifest lists "
                                    "it): the checkpoint is incomplete", file)
    rank, world = share
    for name in names[rank::world]:
        verify(path, name, manifest.files[name])


# -- errors of the file system ---------------------------------------------------------------------------------------
_CAUSES = {
    errno.ENOSPC: "the disk is full (ENOSPC): free space or choose another directory",
    errno.EDQUOT: "the disk quota is exhausted (EDQUOT)",
    errno.EROFS: "the file system is read-only (EROFS): choose a writable directory",
    errno.EACCES: "permission denied (EACCES)",
    errno.EPERM: "operation not permitted (EPERM)",
    errno.ENOENT: "it is missing (ENOENT)",
    errno.EIO: "an I/O error (EIO): the disk or the network file system failed",
}


def described(e: OSError, file: str, doing: str) -> OSError:
    """The same kind of OSError (same errno), with a message naming the file and the cause."""
    cause = _CAUSES.get(e.errno, "")
    text = f"{doing} {file}: {cause}{'; ' if cause else ''}{e.strerror or e}"
    return OSError(e.errno, text, file) if e.errno is not None else OSError(text)


# -- a save on disk --------------------------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_checkpoint(path: str) -> bool:
    """Whether the directory `path` holds a pstar-fx manifest and nothing that manifest does not list (so replacing
    it loses nothing of the user's). A manifest damaged so that its checksum fails still counts when it parses."""
    for name in (PLAIN_MANIFEST, SHARDED_MANIFEST):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        with open(file, "rb") as f:
            data = f.read()
        head = _HEAD.match(data)
        try:
            body = json.loads(data[head.end():-2]) if head and data.endswith(b"}\n") else None
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME or not isinstance(body.get("files"), dict):
            continue
        return set(os.listdir(path)) <= set(body["files"]) | {name}
    return False


_MAX_LINKS = 40          # symbolic links followed from a save's path before it counts as a loop (as Linux's ELOOP)


def save_target(path: str) -> str:
    """Where a save to `path` publishes its checkpoint: `path` itself, or, where `path` is a symbolic link (to a
    directory, or dangling), what the link points to, followed link by link (a relative link from the link's own
    directory). The temporary directory is made beside that target and renamed onto it, so the link is kept and
    points at the new checkpoint, and nothing is left beside the link. A link whose parent directories are links
    needs nothing: the file system follows those. ValueError for links that loop, or that lead to a root."""
    target = path
    for _ in range(_MAX_LINKS + 1):
        if not os.path.islink(target):
            break
        target = os.path.join(os.path.dirname(target), os.readlink(target)).rstrip(os.sep) or os.sep
        if os.path.basename(target) in ("", ".", ".."):      # a link to "." or "..": the directory it names
            target = os.path.realpath(target)
    else:
        raise ValueError(f"step.save: {path!r} is a symbolic link that leads to a loop (more than {_MAX_LINKS} "
                         f"links, the last {target!r}); nothing was changed. Point it at a directory, or pass a "
                         "directory name")
    if os.path.dirname(target) == target:
        raise ValueError(f"step.save: {path!r} is a symbolic link to the root directory {target!r}; nothing was "
                         "changed. Point it at a checkpoint directory, or pass a directory name")
    return target


def prepare(path: str) -> tuple[str, str, str]:
    """Before writing (rank 0): find where the checkpoint goes (`save_target`: `path`, or the target of the link
    `path` is), check what is there, make the temporary directory beside it; returns (target, tmp, old)."""
    target = save_target(path)
    shown = repr(path) if target == path else f"{path!r} (a symbolic link to {target!r})"
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise ValueError(f"step.save: {shown} exists and is not a directory; pass a directory name")
        if os.listdir(target) and not is_checkpoint(target):
            names = sorted(os.listdir(target))
            raise ValueError(f"step.save: {shown} holds files that are not a pstar-fx checkpoint's ({names[:3]}"
                             f"{'...' if len(names) > 3 else ''}: a checkpoint has a manifest listing every file); "
                             "nothing was changed. Save into a new directory, an empty one, or a pstar-fx checkpoint, "
                             "which is replaced as a whole")
    parent = os.path.dirname(os.path.abspath(target))
    tag = uuid.uuid4().hex[:8]
    tmp, old = f"{target}.tmp-{tag}", f"{target}.old-{tag}"
    for make, where in ((lambda: os.makedirs(parent, exist_ok=True), parent), (lambda: os.mkdir(tmp), tmp)):
        try:
            make()
        except OSError as e:
            raise described(e, where, "step.save: creating") from e
    return target, tmp, old


def publish(path: str, tmp: str, old: str) -> None:
    """After every rank has written (rank 0): the temporary directory takes the checkpoint's name (`path`: the target
    `prepare` returned, never a symbolic link); then what earlier, killed saves left beside it goes (never before: an
    '.old-*' may have been the only whole checkpoint)."""
    parent = os.path.dirname(os.path.abspath(path))
    fsync_dir(tmp)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)
    try:
        remove_stale(path)
    except OSError:
        pass                 # best effort: the checkpoint is published; a later save tries again


def _stale(directory: str) -> bool:
    """Whether a directory holds nothing but files a save writes (so it is a killed save's, not the user's)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return False
    return all(e.is_file(follow_symlinks=False) and (e.name in DATA_FILES or e.name in MANIFEST_OF.values()
                                                     or _SHARD_FILE.fullmatch(e.name)) for e in entries)


def remove_stale(path: str) -> None:
    """Remove `<path>.tmp-<8 hex>` and `<path>.old-<8 hex>` directories holding only checkpoint files: what saves
    killed before they finished left. Only after `path` holds a new checkpoint; one save to a path at a time."""
    parent = os.path.dirname(os.path.abspath(path))
    for name in _aside(path):
        where = os.path.join(parent, name)
        if os.path.isdir(where) and not os.path.islink(where) and _stale(where):
            shutil.rmtree(where, ignore_errors=True)
