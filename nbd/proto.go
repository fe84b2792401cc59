package nbd

// Wire constants from NetworkBlockDevice/nbd doc/proto.md. Every integer on the wire is
// big-endian ("network byte order", proto.md "Conventions").

// Magic numbers.
const (
	magicNBD              = 0x4e42444d41474943 // "NBDMAGIC", the INIT_PASSWD
	magicOpt              = 0x49484156454F5054 // "IHAVEOPT"
	magicOptReply         = 0x0003e889045565a9
	magicRequest          = 0x25609513
	magicSimpleReply      = 0x67446698
	magicStructuredReply  = 0x668e33ef
	requestHeaderLen      = 28
	simpleReplyHeaderLen  = 16
	structuredHeaderLen   = 20
	optionHeaderLen       = 16
	optionReplyHeaderLen  = 20
	exportNameReplyZeroes = 124
)

// Handshake flags (server) and client flags, proto.md "Handshake flags", "Client flags".
const (
	flagFixedNewstyle  = 1 << 0
	flagNoZeroes       = 1 << 1
	flagCFixedNewstyle = 1 << 0
	flagCNoZeroes      = 1 << 1
)

// Option types, proto.md "Option types".
const (
	optExportName        = 1
	optAbort             = 2
	optList              = 3
	optPeekExport        = 4
	optStartTLS          = 5
	optInfo              = 6
	optGo                = 7
	optStructuredReply   = 8
	optListMetaContext   = 9
	optSetMetaContext    = 10
	optExtendedHeaders   = 11
	repFlagError         = 1 << 31
	repAck               = 1
	repServer            = 2
	repInfo              = 3
	repErrUnsup          = repFlagError | 1
	repErrPolicy         = repFlagError | 2
	repErrInvalid        = repFlagError | 3
	repErrPlatform       = repFlagError | 4
	repErrTLSReqd        = repFlagError | 5
	repErrUnknown        = repFlagError | 6
	repErrShutdown       = repFlagError | 7
	repErrBlockSizeReqd  = repFlagError | 8
	repErrTooBig         = repFlagError | 9
	infoExport           = 0
	infoName             = 1
	infoDescription      = 2
	infoBlockSize        = 3
	infoExportPayloadLen = 2 + 8 + 2
	infoBlockPayloadLen  = 2 + 4 + 4 + 4
)

// Transmission flags, proto.md "Transmission flags".
const (
	tflagHasFlags        = 1 << 0
	tflagReadOnly        = 1 << 1
	tflagSendFlush       = 1 << 2
	tflagSendFUA         = 1 << 3
	tflagRotational      = 1 << 4
	tflagSendTrim        = 1 << 5
	tflagSendWriteZeroes = 1 << 6
	tflagSendDF          = 1 << 7
	tflagCanMultiConn    = 1 << 8
	tflagSendResize      = 1 << 9
	tflagSendCache       = 1 << 10
	tflagSendFastZero    = 1 << 11
)

// Commands and command flags, proto.md "Request types", "Command flags".
const (
	cmdRead        = 0
	cmdWrite       = 1
	cmdDisc        = 2
	cmdFlush       = 3
	cmdTrim        = 4
	cmdCache       = 5
	cmdWriteZeroes = 6
	cmdBlockStatus = 7

	cmdFlagFUA      = 1 << 0
	cmdFlagNoHole   = 1 << 1
	cmdFlagDF       = 1 << 2
	cmdFlagReqOne   = 1 << 3
	cmdFlagFastZero = 1 << 4
)

// Structured reply flags and chunk types, proto.md "Structured reply types".
const (
	replyFlagDone        = 1 << 0
	chunkNone            = 0
	chunkOffsetData      = 1
	chunkOffsetHole      = 2
	chunkError           = 1<<15 | 1
	chunkErrorOffset     = 1<<15 | 2
	chunkErrorPayloadLen = 4 + 2 // error, message length
)

// Error values, proto.md "Error values".
const (
	errPerm     = 1
	errIO       = 5
	errNoMem    = 12
	errInval    = 22
	errNoSpc    = 28
	errOverflow = 75
	errNotSup   = 95
	errShutdown = 108
)

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
