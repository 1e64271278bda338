"""The streamed S3 PUT body: the pieces' bytes in order, rewindable for botocore's retries."""

import io
import os

import pytest

from longstraw.storage.chunks import PiecesReader


def _pieces(sizes):
    return [memoryview(os.urandom(n)) for n in sizes]


@pytest.mark.parametrize("read_size", [1, 7, 4096, 1 << 20])
def test_reads_the_pieces_in_order(read_size):
    pieces = _pieces([5, 0, 3000, 1, 70_000])
    want = b"".join(pieces)
    body = io.BufferedReader(PiecesReader(pieces), buffer_size=read_size)
    got = bytearray()
    while chunk := body.read(read_size):
        got += chunk
    assert bytes(got) == want


def test_seek_and_rewind_reproduce_the_bytes():
    pieces = _pieces([10, 20, 30])
    want = b"".join(pieces)
    raw = PiecesReader(pieces)
    assert raw.seek(0, io.SEEK_END) == 60
    raw.seek(15)
    buf = bytearray(25)
    assert raw.readinto(buf) == 25 and bytes(buf) == want[15:40]
    assert raw.tell() == 40
    raw.seek(-5, io.SEEK_CUR)
    assert raw.read() == want[35:]
    raw.seek(0)
    assert raw.read() == want
    with pytest.raises(ValueError, match="negative seek"):
        raw.seek(-1)
