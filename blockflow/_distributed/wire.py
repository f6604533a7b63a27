"""distributed's TCP framing (uint64 length prefix, ``pack_frames``), and :func:`unpickle`."""

from __future__ import annotations

import struct
from typing import Any

from distributed.protocol.pickle import loads as _pickle_loads

__all__ = ["HEADER_BYTES", "client_handshake", "decode_message", "message_length", "unpickle"]

#: Bytes of the length prefix before each message (a little-endian uint64).
HEADER_BYTES = 8


def client_handshake() -> bytes:
    """The bytes of the handshake a Dask client sends first."""
    import pickle
    import sys

    from distributed.protocol import dumps
    from distributed.protocol.utils import pack_frames

    packed = pack_frames(dumps({"compression": None, "python": tuple(sys.version_info)[:3],
                                "pickle-protocol": pickle.HIGHEST_PROTOCOL}))
    return struct.pack("<Q", len(packed)) + packed


def message_length(header: bytes) -> int:
    """Bytes of the message announced by a :data:`HEADER_BYTES`-byte length prefix."""
    (n,) = struct.unpack("<Q", header)
    return n


def decode_message(payload: bytes) -> Any | None:
    """The message in ``payload`` (after the length prefix), undeserialised; None if incomplete."""
    try:
        from distributed.protocol import loads
        from distributed.protocol.utils import unpack_frames

        frames, missing = unpack_frames(payload, partial=True)
        return loads(frames, deserialize=False) if not missing else None
    except Exception:
        return None


def unpickle(data: bytes) -> Any:
    """The object pickled in ``data`` (``distributed.protocol.pickle.loads``)."""
    return _pickle_loads(data)
