"""Whether a checkpoint's storage is shared with other machines (the cooperation decision of
``cooperate="auto"``): the kernel's mount table read right, and one observation for every rank."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hp_dcp_hf import HFStorageReader
from hp_dcp_hf.storage.format.catalog import Catalog
from hp_dcp_hf.storage.transport import mounts

TABLE = """\
/dev/vda1 / ext4 rw,relatime 0 0
proc /proc proc rw 0 0
server:/export /mnt/ckpt nfs4 rw,vers=4.2 0 0
/dev/vdb /mnt/ckpt/local ext4 rw 0 0
lustre@tcp:/fs /lustre lustre rw 0 0
s3fs /mnt/bucket fuse.s3fs rw 0 0
/dev/sdc1 /mnt/windows fuseblk rw 0 0
server:/with\\040space /mnt/with\\040space nfs rw 0 0
/dev/vdc /mnt/over ext4 rw 0 0
server:/over /mnt/over nfs rw 0 0
"""


@pytest.mark.parametrize(("path", "kind"), [
    ("/home/user/model", "ext4"),
    ("/mnt/ckpt/llama", "nfs4"),
    ("/mnt/ckpt", "nfs4"),
    ("/mnt/ckptx/llama", "ext4"),  # a longer name is not under the mount point
    ("/mnt/ckpt/local/llama", "ext4"),  # a local disk mounted inside the NFS export
    ("/lustre/project/ckpt", "lustre"),
    ("/mnt/bucket/model", "fuse.s3fs"),
    ("/mnt/windows/model", "fuseblk"),
    ("/mnt/with space/model", "nfs"),  # the kernel writes a space as \040
    ("/mnt/over/model", "nfs"),  # a later mount over the same point hides the earlier one
])
def test_the_filesystem_of_a_path_is_its_longest_mount(path, kind):
    assert mounts.filesystem_type(path, TABLE) == kind


@pytest.mark.parametrize(("kind", "shared"), [
    ("ext4", False), ("xfs", False), ("tmpfs", False), ("overlay", False), ("fuseblk", False), (None, False),
    ("nfs", True), ("nfs4", True), ("lustre", True), ("gpfs", True), ("beegfs", True), ("ceph", True),
    ("cifs", True), ("fuse.s3fs", True), ("fuse.juicefs", True), ("fuse.gcsfuse", True),
])
def test_network_cluster_and_fuse_filesystems_are_shared(kind, shared):
    assert mounts.is_shared(kind) is shared


@pytest.fixture
def checkpoint(tmp_path):
    save_file({"w": torch.zeros(4, 4)}, tmp_path / "model.safetensors")
    return tmp_path


def _table(tmp_path, root: str, kind: str):
    table = tmp_path / "mounts"
    table.write_text(f"/dev/vda1 / ext4 rw 0 0\nserver:/x {root} {kind} rw 0 0\n")
    return str(table)


@pytest.mark.parametrize(("kind", "auto"), [("ext4", False), ("nfs4", True), ("lustre", True), ("fuse.s3fs", True)])
def test_auto_cooperates_on_shared_filesystems_and_reads_node_local_disks_directly(checkpoint, monkeypatch,
                                                                                   kind, auto):
    monkeypatch.setattr(mounts, "MOUNT_TABLE", _table(checkpoint, str(checkpoint), kind))
    decisions = {}
    for cooperate in ("auto", "always", "never"):
        reader = HFStorageReader(str(checkpoint), cooperate=cooperate)
        reader.read_metadata()
        decisions[cooperate] = reader.cooperates(4)
        assert reader.cooperates(1) is False  # one rank has no replica
    assert decisions == {"auto": auto, "always": True, "never": False}


def test_every_rank_decides_from_the_scanning_ranks_observation(checkpoint, monkeypatch):
    """The catalog rank 0 broadcasts carries what it saw; a rank that sees another mount table
    (a node where the path is mounted otherwise) still takes rank 0's decision."""
    monkeypatch.setattr(mounts, "MOUNT_TABLE", _table(checkpoint, str(checkpoint), "nfs4"))
    reader = HFStorageReader(str(checkpoint))
    catalog = reader._scan()
    assert catalog.shared and Catalog.from_json(catalog.to_json()).shared
    monkeypatch.setattr(mounts, "MOUNT_TABLE", _table(checkpoint, str(checkpoint), "ext4"))
    received = Catalog.from_json(catalog.to_json())
    assert received.shared  # what the receiving rank's own table says does not enter
    assert not reader._scan().shared
