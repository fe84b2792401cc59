#!/usr/bin/python3
# readchunks.py URI OFF LEN: one structured read through libnbd (python3-libnbd); prints
# one line per chunk the server sent, "data OFF LEN", "hole OFF LEN" or "error OFF ERRNO",
# then "result ok" or "result err ERRNO". libnbd calls the chunk callback with READ_ERROR
# only for NBD_REPLY_TYPE_ERROR_OFFSET, so an "error" line is the offset the server named.
#
#   readchunks.py cache URI OFF LEN   sends NBD_CMD_CACHE instead; prints "cache ok".
import sys

import nbd


def main(argv):
    h = nbd.NBD()
    if argv[1] == "cache":
        h.connect_uri(argv[2])
        h.cache(int(argv[4]), int(argv[3]))
        print("cache ok")
        h.shutdown()
        return
    uri, off, length = argv[1], int(argv[2]), int(argv[3])
    h.connect_uri(uri)
    if not h.get_structured_replies_negotiated():
        sys.exit("structured replies were not negotiated")

    def chunk(subbuf, offset, status, err):
        if status == nbd.READ_DATA:
            print("data", offset, len(subbuf), flush=True)
        elif status == nbd.READ_HOLE:
            print("hole", offset, len(subbuf), flush=True)
        elif status == nbd.READ_ERROR:
            print("error", offset, err.value, flush=True)
        return 0

    try:
        h.pread_structured(length, off, chunk)
        print("result ok")
    except nbd.Error as e:
        print("result err", e.errno or e.errnum)
    h.shutdown()


if __name__ == "__main__":
    main(sys.argv)
