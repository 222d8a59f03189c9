"""Candidates that reach past the sandbox through the kernel rather than the file system: the session
keyring (read every key, smuggle the payloads out XOR-encoded in an error, plant a key of its own),
system calls no kernel needs, loopback TCP, and Unix-socket buffers held past the memory limit."""

import ctypes
import errno
import socket

import jax.numpy as jnp

KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING = -3, -4
KEYCTL_READ = 11
PLANTED = b"planted-by-a-candidate"
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS = {"keyctl": 250, "add_key": 248, "ptrace": 101, "bpf": 321, "unshare": 272, "perf_event_open": 298,
       "userfaultfd": 323, "mount": 165}  # x86-64 numbers


def _call(name, *args):
    result = _libc.syscall(ctypes.c_long(SYS[name]), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return result, ctypes.get_errno()


def _read(key_id: int) -> bytes:
    buf = ctypes.create_string_buffer(4096)
    n, _ = _call("keyctl", KEYCTL_READ, key_id, buf, 4096)
    return buf.raw[:max(n, 0)]


def keyring_reader(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Plant a key, then read every key of the session and user keyrings and raise with them XOR-encoded."""
    _call("add_key", ctypes.c_char_p(b"user"), ctypes.c_char_p(PLANTED), ctypes.c_char_p(b"x"), 1,
          KEY_SPEC_SESSION_KEYRING)
    found = []
    for ring in (KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING):
        ids = _read(ring)
        for i in range(0, len(ids) - 3, 4):
            found.append(_read(int.from_bytes(ids[i:i + 4], "little", signed=True)))
    loot = b"|".join(found)
    if loot:
        raise RuntimeError("keys: " + bytes(b ^ 0x5A for b in loot).hex() + " plain: " + loot.decode("latin-1"))
    _, code = _call("keyctl", KEYCTL_READ, KEY_SPEC_SESSION_KEYRING, None, 0)
    raise RuntimeError(f"no key reached: keyctl said {errno.errorcode.get(code, code)}")


def forbidden_calls(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Every call the filter refuses; raises with what each said (a zero result would be an escape)."""
    said = {}
    for name, args in (("ptrace", (0, 1, 0, 0)), ("bpf", (0, 0, 0)), ("unshare", (0x10000000,)),
                       ("perf_event_open", (0, 0, -1, -1, 0)), ("userfaultfd", (0,)),
                       ("mount", (None, None, None, 0, None))):
        result, code = _call(name, *args)
        said[name] = "allowed" if result >= 0 else errno.errorcode.get(code, str(code))
    raise RuntimeError("calls: " + ", ".join(f"{n}={s}" for n, s in said.items()))


def tcp_hog(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Hold loopback TCP buffers inside the sandbox's network namespace."""
    held = []
    server = socket.create_server(("127.0.0.1", 0))  # refused by the filter: the error names the family
    for _ in range(2000):
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
        a.setblocking(False)
        try:
            while True:
                a.send(b"x" * 65536)
        except BlockingIOError:
            held.append((a, b))
    return jnp.zeros(q.shape, q.dtype)


def unix_hog(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    """Hold about 3 GiB in Unix-socket buffers (pairs never read), then return zeros."""
    held, total = [], 0
    while total < (3 << 30):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
        a.setblocking(False)
        try:
            while True:
                total += a.send(b"x" * 65536)
        except BlockingIOError:
            held.append((a, b))
        if len(held) > 3000:
            break
    return jnp.zeros(q.shape, q.dtype)
