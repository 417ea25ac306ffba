#!/usr/bin/env python3
"""An independent transcription of kvserve's 128-bit content-key hash (rust/core/src/kv/prefix.rs)
in Python big-integer arithmetic, used to derive the fixed values that `keys_are_stable` checks.

Keys may be stored outside the process (sessions on disk, a shared KV tier), so the Rust function
must never change silently: if this script and the Rust test disagree, one of them is wrong.

    python scripts/key_reference.py    # prints the three test constants
"""

from __future__ import annotations

M64 = (1 << 64) - 1
C0 = 0x6A09E667F3BCC908
C1 = 0xBB67AE8584CAA73B
C2 = 0x3C6EF372FE94F82B
C3 = 0xA54FF53A5F1D36F1


def rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def fold_mul(a: int, b: int) -> int:
    r = a * b
    return (r & M64) ^ (r >> 64)


def avalanche(h: int) -> int:
    h ^= h >> 31
    h = (h * (C3 | 1)) & M64
    h ^= h >> 29
    h = (h * (C1 | 1)) & M64
    return h ^ (h >> 32)


class KeyHasher:
    def __init__(self, domain: int) -> None:
        self.a = C0 ^ domain
        self.b = C1 ^ rotl(domain, 32)
        self.n = 0

    def write_u64(self, w: int) -> None:
        a = fold_mul(self.a ^ w ^ C2, rotl(self.b, 23) ^ C3)
        b = fold_mul(self.b ^ rotl(w, 29) ^ C3, rotl(self.a, 41) ^ C2)
        self.a, self.b, self.n = a, b, self.n + 1

    def write_u128(self, k: int) -> None:
        self.write_u64(k & M64)
        self.write_u64(k >> 64)

    def write_bytes(self, data: bytes) -> None:
        for i in range(0, len(data), 8):
            self.write_u64(int.from_bytes(data[i : i + 8].ljust(8, b"\0"), "little"))
        self.write_u64(len(data))

    def finish(self) -> int:
        a = avalanche(self.a ^ fold_mul(self.n ^ C1, C0))
        b = avalanche(self.b ^ rotl(a, 17) ^ C2)
        a = avalanche(a ^ b)
        return (b << 64) | a


def block_key(model_id: int, parent: int, tokens: list[int]) -> int:
    h = KeyHasher(0x6B76736572766542)
    h.write_u128(model_id)
    h.write_u128(parent)
    for i in range(0, len(tokens) - 1, 2):
        h.write_u64(tokens[i] | (tokens[i + 1] << 32))
    if len(tokens) % 2:
        h.write_u64(tokens[-1] | (1 << 63))
    h.write_u64(len(tokens))
    k = h.finish()
    return 1 if k == 0 else k


def main() -> None:
    t = [i * 1000 + 7 for i in range(16)]
    print("KEY_A", block_key(0, 0, t))
    model_b = (0xDEADBEEF << 70 | 12345) % (1 << 128)
    print("KEY_B", block_key(model_b, 12345678901234567 << 40, t[:15]))
    h = KeyHasher(3)
    h.write_bytes(b"kvserve model id!")
    print("KEY_C", h.finish())


if __name__ == "__main__":
    main()
