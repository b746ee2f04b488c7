"""Whether a local path lies on storage that other machines read too, from the kernel's mount table.

A checkpoint on a node's own disk is read from that disk and its page cache: ranks reading it
directly pay nothing for sharing it. On a network or cluster file system (NFS, Lustre, GPFS, ...) or
a FUSE mount of a remote store, every byte a rank reads crosses the network from one server, as
from S3, and cooperation pays as it does there.
"""

from __future__ import annotations

import os

MOUNT_TABLE = "/proc/self/mounts"

SHARED_TYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "cifs", "smb3", "smbfs", "glusterfs", "panfs",
    "wekafs", "orangefs", "pvfs2", "afs", "davfs", "ocfs2", "gfs2",
})
"""File system types whose files other machines read too: network and cluster file systems (not
``9p`` or ``virtiofs``: a virtual machine's view of its host's disk, and some sandboxes' root)."""


def _unescape(field: str) -> str:
    """A mount table field: the kernel writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_type(path: str, mount_table: str | None = None) -> str | None:
    """The type of the file system ``path`` lies on (``"ext4"``, ``"nfs4"``, ``"fuse.s3fs"``): the
    mount with the longest mount point above its real path. ``mount_table``: the table's text
    (default: this process's, ``/proc/self/mounts``); None when it cannot be read."""
    if mount_table is None:
        try:
            with open(MOUNT_TABLE) as table:
                mount_table = table.read()
        except OSError:
            return None
    real = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for line in mount_table.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point, kind = _unescape(fields[1]), fields[2]
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):  # a later mount over the same point wins
            best = (len(point), kind)
    return None if best is None else best[1]


def is_shared(kind: str | None) -> bool:
    """Whether files of file system type ``kind`` are read from storage other machines share: the
    network and cluster types, and FUSE mounts (``fuse.*``: s3fs, gcsfuse, JuiceFS, sshfs, ...;
    not ``fuseblk``, a local disk)."""
    return kind is not None and (kind in SHARED_TYPES or kind.startswith("fuse."))
