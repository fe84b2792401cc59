// Package blockdev implements an attached eli volume: a Device reads and writes the
// plaintext of the sectors a provider holds encrypted, in the layout of docs/format.md.
//
// A Device serves any byte range, with ReadAt, WriteAt, WriteZeroes, Trim, Flush, Cache
// and Extents, and is safe for concurrent use: an NBD server calls it from many requests
// and connections. A Flush, or a write with FUA, makes every write that completed before
// it durable, whichever connection it came from.
//
// In authenticated modes every sector is sealed with a fresh nonce, and a read of a
// sector that was changed, moved or copied from another volume fails with an error
// wrapping sector.ErrAuth; an older version of a sector put back whole is not detected
// (docs/threat-model.md). Writes are committed through a journal, so that after a crash
// at any instant every sector reads as its old or its new contents, and what was made
// durable is there. Length-preserving modes encrypt sectors in place, like a plain disk:
// they detect no change, and a crash can tear a sector.
//
// Errors wrap the syscall.Errno an NBD server reports: EINVAL (a request outside the
// device), ENOSPC (a write past its end), EPERM (read-only), ESHUTDOWN (closed), ENOTSUP
// (FastZero where zeroing is slow), EIO (a sector that fails authentication, or a failed
// provider, after which the device accepts no writes).
//
// A Device does not lock the provider and never wipes the codec: both are the caller's.
package blockdev
