package nbd

// Limits on what a client may make the server hold.
const (
	// MaxRequest is the largest READ or WRITE payload accepted, and the default maximum
	// block size advertised: 64 MiB, twice the length below which proto.md ("Block size
	// constraints") says a request SHOULD NOT be deemed a denial of service, as nbdkit
	// accepts. A longer WRITE is refused with an error after its payload is skipped (up
	// to maxSkip; beyond that the connection ends).
	MaxRequest = 64 << 20
	// maxString is the spec's hard limit on a string (export name, message).
	maxString = 4096
	// maxOptionData bounds the option data the server reads into memory. NBD_OPT_GO with a
	// 4096-byte name and a handful of info requests fits easily.
	maxOptionData = 8 << 10
	// maxOptionSkip bounds the option data the server will read and throw away to reply
	// to an option it does not take; more than that is treated as a denial of service.
	maxOptionSkip = 64 << 10
	// maxOptions bounds the number of options in one handshake.
	maxOptions = 1024
	// maxErrorMessage bounds the human-readable text in an error chunk or option reply.
	maxErrorMessage = 256
)
