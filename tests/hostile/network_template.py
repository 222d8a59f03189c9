"""Connects to a listener the test opened on 127.0.0.1 (its port written in PORT by the test), over TCP
and through the abstract unix socket name ABSTRACT, and sends the first bytes of q."""

import socket

PORT = 0
ABSTRACT = ""


def attention(q, k, v, **kwargs):
    import numpy as np

    sent = []
    try:
        with socket.create_connection(("127.0.0.1", PORT), timeout=2) as s:
            s.sendall(np.asarray(q).tobytes()[:64])
            sent.append("tcp")
    except OSError as e:
        sent.append(f"tcp refused ({type(e).__name__})")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect("\0" + ABSTRACT)
            s.sendall(np.asarray(q).tobytes()[:64])
            sent.append("unix")
    except OSError as e:
        sent.append(f"unix refused ({type(e).__name__})")
    raise RuntimeError(f"network: {sent}")
