#!/usr/bin/python3
# nbddiff.py: differential test of an NBD export against a reference export of the same
# size, both driven by libnbd (python3-libnbd), for eli's integration tests.
#
#   nbddiff.py URI REFERENCE SEED OPS ROUNDS
#   nbddiff.py compare URI REFERENCE      only the final comparison (after a re-attach)
#
# Phase 1, OPS requests one at a time, the same on both exports: writes, write-zeroes
# (with and without NO_HOLE), trims, flushes, caches and reads, of random lengths from 1
# byte to 1 MiB at random offsets (half of them sector-aligned), a tenth with FUA. Every
# read must return the same bytes from both. A trim leaves contents unspecified (NBD), so
# the range is zeroed on both afterwards.
#
# Phase 2, ROUNDS rounds: a 32 KiB region is cut into 128 disjoint pieces of random
# length, which are written (a tenth zeroed) through four connections at once, with
# everything queued before any reply is awaited. Nearly every piece shares a sector with
# others in flight, so the export must merge concurrent partial writes of one sector
# without losing any.
# The reference gets the same pieces one by one; the regions must then match.
#
# Finally the whole exports must match, read on a fresh connection after a flush, and
# every extent that NBD_CMD_BLOCK_STATUS (base:allocation) calls zero must read as zeroes
# (a hole may read as anything, so only the zero flag is held to its word). The
# exports are zeroed first: a never-written sector of a length-preserving mode reads as
# whatever its ciphertext decrypts to. Prints "ok" and how much block status called zero,
# or what differed and exits non-zero.
import random
import sys

import nbd


def connect(uri, meta=False):
    h = nbd.NBD()
    if meta:
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    h.connect_uri(uri)
    return h


def first_diff(a, b):
    return next(k for k in range(min(len(a), len(b))) if a[k] != b[k])


def main(argv):
    if argv[1] == "compare":
        B = connect(argv[3])
        compare(argv[2], B, B.get_size())
        return
    uri, ref, seed, ops, rounds = argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5])
    r = random.Random(seed)
    A, B = connect(uri), connect(ref)
    size = A.get_size()
    if B.get_size() != size:
        sys.exit(f"sizes differ: {size} and {B.get_size()}")
    for o in range(0, size, 32 << 20):
        n = min(32 << 20, size - o)
        A.zero(n, o, nbd.CMD_FLAG_NO_HOLE)
        B.zero(n, o)

    def length():
        k = r.random()
        if k < 0.3:
            return r.randint(1, 600)
        if k < 0.6:
            return r.choice([512, 4096, 8192, 65536]) * r.randint(1, 4)
        return r.randint(1, 1 << 20)

    def offset(n):
        o = r.randrange(0, max(1, size - n))
        return o if r.random() < 0.5 else o // 4096 * 4096

    for i in range(ops):
        op = r.choice("wwwztfcrrr")
        n = min(length(), size)
        off = offset(n)
        fl = nbd.CMD_FLAG_FUA if r.random() < 0.1 else 0
        where = f"request {i} ({op} of {n} bytes at {off})"
        try:
            if op == "w":
                data = r.randbytes(n)
                A.pwrite(data, off, fl)
                B.pwrite(data, off, fl)
            elif op == "z":
                zf = fl | (nbd.CMD_FLAG_NO_HOLE if r.random() < 0.5 else 0)
                A.zero(n, off, zf)
                B.zero(n, off, zf)
            elif op == "t":
                A.trim(n, off, fl)
                A.zero(n, off)
                B.zero(n, off)
            elif op == "f":
                A.flush()
            elif op == "c":
                A.cache(n, off)
            else:
                a, b = A.pread(n, off), B.pread(n, off)
                if a != b:
                    sys.exit(f"{where}: byte {off + first_diff(a, b)} differs")
        except nbd.Error as e:
            sys.exit(f"{where}: {e}")

    hs = [connect(uri) for _ in range(4)]
    region = min(size, 32 << 10)
    for rd in range(rounds):
        base = r.randrange(0, size - region + 1)
        cuts = sorted(r.sample(range(1, region), 127))
        pieces = list(zip([0] + cuts, cuts + [region]))
        r.shuffle(pieces)
        for k, (lo, hi) in enumerate(pieces):
            h = hs[k % len(hs)]
            fl = nbd.CMD_FLAG_FUA if r.random() < 0.05 else 0
            if r.random() < 0.1:
                h.aio_zero(hi - lo, base + lo, flags=fl)
                B.zero(hi - lo, base + lo)
            else:
                data = r.randbytes(hi - lo)
                h.aio_pwrite(data, base + lo, flags=fl)
                B.pwrite(data, base + lo)
        for h in hs:
            while h.aio_in_flight() > 0:
                h.poll(-1)
        a, b = hs[rd % len(hs)].pread(region, base), B.pread(region, base)
        if a != b:
            sys.exit(f"round {rd}: byte {base + first_diff(a, b)} of the concurrent writes differs (a lost update)")
    for h in hs:
        h.shutdown()

    A.flush()
    A.shutdown()
    compare(uri, B, size)


def compare(uri, B, size):
    A = connect(uri, meta=True)
    if A.get_size() != size:
        sys.exit(f"sizes differ: {A.get_size()} and {size}")
    image = bytearray()
    for o in range(0, size, 1 << 20):
        n = min(1 << 20, size - o)
        a, b = A.pread(n, o), B.pread(n, o)
        if a != b:
            sys.exit(f"final state: byte {o + first_diff(a, b)} differs")
        image += a

    extents = []

    def status(meta, off, entries, err):
        if meta == nbd.CONTEXT_BASE_ALLOCATION:
            extents.extend(zip(entries[0::2], entries[1::2]))
        return 0

    off, zeroed = 0, 0
    while off < size:
        extents.clear()
        A.block_status(min(size - off, 1 << 30), off, status)
        if not extents:
            sys.exit(f"block status at {off}: no extents")
        for n, flags in extents:
            n = min(n, size - off)
            if flags & nbd.STATE_ZERO:
                if any(image[off:off + n]):
                    sys.exit(f"block status calls {n} bytes at {off} zero, but byte {off + first_diff(image[off:off + n], bytes(n))} is not")
                zeroed += n
            off += n
            if off >= size:
                break
    print(f"ok: {zeroed} bytes in zero extents")


if __name__ == "__main__":
    main(sys.argv)
