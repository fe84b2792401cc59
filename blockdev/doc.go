// Package blockdev is the attached eli volume: the plaintext sectors of a provider, through
// a sector.Codec, in the layout of docs/format.md. A Device serves ReadAt, WriteAt (with
// FUA), WriteZeroes, Trim and Flush for any byte range, concurrently.
//
// # Authenticated modes
//
// Every write seals its sectors at once, with a fresh nonce each, into a slab owned by the
// *pending batch*: a map from sector to (ciphertext, record), kept in spans of 16 sectors
// (sectormap.go), where a rewrite replaces the older entry. Reads see the pending batch,
// then the committing one, then the provider.
// One committer goroutine commits batches in order; each commit is one or more rounds of
// journal (old and new records), sync, data and records in place, sync — docs/format.md,
// "Journal". A batch is committed when a Flush or FUA write waits for it, when it holds
// CommitBytes, or CommitInterval after its first write; while a commit runs, the next
// batch may grow to MaxBatchBytes, beyond which writers wait (memory stays bounded). A Flush waits for the newest batch that holds a completed write, so it
// covers writes from every connection.
//
// Why this is crash safe: data is written in place only after the journal naming its
// sector's old and new record is durable, so after a crash at any instant recovery finds
// each sector with old or new data and old, new or torn record, and the journal tells it
// which record matches (docs/format.md). What was acknowledged before a completed Flush,
// or with FUA, was in a batch whose commit completed. crash_test.go checks this at every
// point of recorded workloads, with writes lost or torn.
//
// Readers never see a mismatched (data, record) pair: see read.go for the second look
// that settles a read racing a commit. Writes smaller than a sector are read-modify-write
// under the sector's stripe lock, which every write takes to insert, so no update is lost.
//
// The metadata cache (metacache.go) holds metadata blocks, least recently used out, within
// CacheBytes; a commit pins the blocks of one round at a time, so rounds are also bounded
// by half the cache. Large requests are sealed and opened by a fixed pool of GOMAXPROCS
// workers in 64 KiB chunks (the caller works too); requests of one chunk or less never
// touch the pool. The provider is read and written in parallel pieces of up to 256 KiB
// too: the kernel's copy to and from the page cache costs about half as much as the
// cipher.
//
// # Length-preserving modes
//
// No metadata, no journal, no batch: writes encrypt and go straight to the provider,
// Flush syncs, FUA writes then syncs. Trim punches whole sectors out where the provider
// can; they then read as the decryption of zeroes, which NBD allows after a trim.
//
// # Errors
//
// Errors wrap the syscall.Errno an NBD server reports: EINVAL (a read outside the device),
// ENOSPC (a write past its end), EPERM (read-only), ESHUTDOWN (closed), ENOTSUP (FastZero
// where zeroing is slow), EIO (sector.ErrAuth: a sector that fails authentication, logged
// once per index; a failed provider, after which the device accepts no writes).
//
// Device does not lock the provider (the CLI does, with provider.File.Lock) and never
// wipes the codec (its keys are the caller's); it wipes its copy of the journal key.
package blockdev
