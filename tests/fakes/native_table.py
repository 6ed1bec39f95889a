"""A recorder standing in for the patched pyfuse3's native READ table (the NativeReadTable
seam of cachefs/fs/native_reads.py), for unit tests of what the worker registers. The real
table is tested in tests/unit/fs/test_native_table.py and through real mounts in
tests/e2e/fs/test_native_reads.py."""

from __future__ import annotations


class RecordingTable:
    """Records every block registered: ``registered`` its index, ``blocks`` (inode, index)."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.blocks: list[tuple[int, int]] = []
        self.peer_names: dict[int, bytes] = {}  # inode -> what its peer requests carry

    def configure(self, chunk_size, max_blocks, max_names) -> None:
        pass

    def register(self, ino, index, block_size, file_size, file_id, path, length, sums,
                 written_ino=0, written_ctime_ns=0) -> bool:  # fmt: skip
        self.registered.append(index)
        self.blocks.append((ino, index))
        return True

    def forget_file(self, file_id) -> None:
        pass

    def register_peer_name(self, ino, identity) -> bool:
        self.peer_names[ino] = identity
        return True

    def answer_peers(self, sock_fd, frames, max_answers):
        return 0, 0, [], None  # answers nothing: every request goes the Python way

    def forget_inodes(self, lo, hi) -> None:
        pass

    def clear(self) -> None:
        pass
