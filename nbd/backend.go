package nbd

// Flags qualify one write-type request.
type Flags uint16

const (
	// FUA: the write must be durable before the reply (NBD_CMD_FLAG_FUA).
	FUA Flags = 1 << iota
	// NoHole: WriteZeroes must allocate rather than punch (NBD_CMD_FLAG_NO_HOLE).
	NoHole
	// FastZero: WriteZeroes must fail with an error wrapping syscall.ENOTSUP unless it is
	// faster than writing zeroes would be (NBD_CMD_FLAG_FAST_ZERO).
	FastZero
)

// Backend is what an export serves. Every method is called concurrently from many
// requests and connections. Offsets and lengths are already checked against Size and
// the export's block sizes when a method is called.
//
// Errors are per request: the server replies with an NBD error and the connection goes
// on. The NBD error code comes from the syscall.Errno that the error wraps (errors.Is):
// EPERM (also EACCES, EROFS), EIO, ENOMEM, EINVAL, ENOSPC (also EDQUOT, EFBIG), EOVERFLOW,
// ENOTSUP, ESHUTDOWN; anything else, an integrity failure included, is EIO. Wrapping an
// *OffsetError says where a read failed.
type Backend interface {
	// Size is the export's size in bytes; it does not change while served.
	Size() int64
	// ReadAt fills all of p or fails; on failure none of p reaches the client.
	ReadAt(p []byte, off int64) error
	// WriteAt writes p (flags: FUA). As with io.WriterAt it must not modify p, and must
	// not keep it after returning: the buffer is reused.
	WriteAt(p []byte, off int64, flags Flags) error
	// WriteZeroes makes [off, off+length) read as zeroes (flags: FUA, NoHole, FastZero).
	// A backend that cannot may fail with ENOTSUP: without FastZero the server then
	// writes zeroes through WriteAt, with it the client gets the ENOTSUP it asked for.
	WriteZeroes(off, length int64, flags Flags) error
	// Trim tells the backend that [off, off+length) is no longer needed; it may then read
	// as anything (for eli: zeroes). ENOTSUP is taken as success: TRIM is a hint.
	Trim(off, length int64, flags Flags) error
	// Flush makes every write that completed before it durable.
	Flush() error
}

// Keeper is an optional Backend extension for WRITE: WriteKeep is WriteAt, except that
// the backend may change p and keep it after returning, until it calls done, at most
// once (before or after returning, whatever the outcome). A backend that seals or
// transforms data for later use can then do so in place instead of copying it out: the
// server reads each payload into a buffer of its own and takes it back into its pool
// through done. A buffer whose done is never called is merely left to the garbage
// collector.
type Keeper interface {
	WriteKeep(p []byte, off int64, flags Flags, done func()) error
}

// Cacher is an optional Backend extension: NBD_CMD_CACHE calls Cache so the backend can
// warm whatever it caches for [off, off+length). Without it, CACHE succeeds and does
// nothing, which proto.md allows ("there is no guarantee of an actual performance gain").
type Cacher interface {
	Cache(off, length int64) error
}

// Export is one named export.
type Export struct {
	Name        string // "" is the default export
	Description string
	Backend     Backend
	ReadOnly    bool
	// Block sizes advertised with NBD_INFO_BLOCK_SIZE. Zero values take defaults:
	// minimum 1, preferred 4096, maximum 32 MiB. The server enforces them: a request
	// not aligned to MinBlock, or a READ or WRITE longer than MaxBlock, fails with
	// EINVAL before the backend sees it (a CACHE, which moves no payload, is bounded by
	// the export's size alone). For eli, MinBlock and PreferredBlock are the
	// volume's sector size.
	MinBlock, PreferredBlock, MaxBlock uint32
	// MultiConn advertises NBD_FLAG_CAN_MULTI_CONN: the backend's Flush covers writes
	// completed on every connection, not just the caller's.
	MultiConn bool
}

// Extent is one run of a BlockStatuser's answer.
type Extent struct {
	Length int64
	// Hole: the run is not allocated (proto.md NBD_STATE_HOLE). Zero: it reads as
	// zeroes (NBD_STATE_ZERO).
	Hole, Zero bool
}

// BlockStatuser is an optional Backend extension that answers NBD_CMD_BLOCK_STATUS for
// the "base:allocation" metadata context, so that clients can skip what is unallocated
// or reads as zeroes. BlockStatus describes [off, off+length): the extents are contiguous
// from off, cover at least one byte and at most length (the client asks again for the
// rest). A backend without it has the whole range reported as allocated data.
type BlockStatuser interface {
	BlockStatus(off, length int64) ([]Extent, error)
}
