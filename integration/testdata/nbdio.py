#!/usr/bin/python3
# nbdio.py: drives an NBD export through libnbd (python3-libnbd) for eli's integration
# tests, so that what they check is what a real libnbd client sees.
#
#   nbdio.py sectors URI S I...   read each sector I (S bytes) on its own; print per sector
#                                 "I ok SHA256HEX" or "I err ERRNO"; errors do not stop it
#   nbdio.py pread URI OFF LEN    write LEN bytes read at OFF to stdout
#   nbdio.py pwrite URI OFF       write stdin at OFF, then flush
#
# Run it with the system Python (/usr/bin/python3), which has the nbd module.
import hashlib
import sys

import nbd


def main(argv):
    if len(argv) < 3:
        sys.exit("usage: nbdio.py sectors|pread|pwrite URI ARGS...")
    cmd, uri, args = argv[1], argv[2], argv[3:]
    h = nbd.NBD()
    h.connect_uri(uri)
    if cmd == "sectors":
        size = int(args[0])
        for i in (int(a) for a in args[1:]):
            try:
                data = h.pread(size, i * size)
                print(i, "ok", hashlib.sha256(data).hexdigest(), flush=True)
            except nbd.Error as e:
                print(i, "err", e.errno or e.errnum, flush=True)
    elif cmd == "pread":
        off, length = int(args[0]), int(args[1])
        sys.stdout.buffer.write(h.pread(length, off))
    elif cmd == "pwrite":
        off = int(args[0])
        data = sys.stdin.buffer.read()
        h.pwrite(data, off)
        h.flush()
    else:
        sys.exit("unknown command " + cmd)
    h.shutdown()


if __name__ == "__main__":
    main(sys.argv)
