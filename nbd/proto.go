package nbd

// Limits on what a client may make the server hold.
const (
	// MaxRequest is the largest READ or WRITE payload accepted: 32 MiB, the length below
	// which proto.md ("Block size constraints") says a request SHOULD NOT be deemed a
	// denial of service. A WRITE announcing more ends the connection, since its payload
	// cannot be taken in without holding it.
	MaxRequest = 32 << 20
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
