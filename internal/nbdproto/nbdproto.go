// Package nbdproto holds the NBD wire constants (NetworkBlockDevice/nbd doc/proto.md),
// shared by eli's server (package nbd) and its client (package nbdclient), so that both
// speak from one definition. Every integer on the wire is big-endian ("network byte
// order", proto.md "Conventions").
package nbdproto

// Magic numbers.
const (
	MagicNBD              = 0x4e42444d41474943 // "NBDMAGIC", the INIT_PASSWD
	MagicOpt              = 0x49484156454F5054 // "IHAVEOPT"
	MagicOptReply         = 0x0003e889045565a9
	MagicRequest          = 0x25609513
	MagicSimpleReply      = 0x67446698
	MagicStructuredReply  = 0x668e33ef
	MagicExtendedRequest  = 0x21e41c71
	MagicExtendedReply    = 0x6e8a278c
	RequestHeaderLen      = 28
	ExtendedRequestLen    = 32
	ExtendedReplyLen      = 32
	SimpleReplyHeaderLen  = 16
	StructuredHeaderLen   = 20
	OptionHeaderLen       = 16
	OptionReplyHeaderLen  = 20
	ExportNameReplyZeroes = 124
)

// Handshake flags (server) and client flags, proto.md "Handshake flags", "Client flags".
const (
	FlagFixedNewstyle  = 1 << 0
	FlagNoZeroes       = 1 << 1
	FlagCFixedNewstyle = 1 << 0
	FlagCNoZeroes      = 1 << 1
)

// Option types, proto.md "Option types".
const (
	OptExportName        = 1
	OptAbort             = 2
	OptList              = 3
	OptPeekExport        = 4
	OptStartTLS          = 5
	OptInfo              = 6
	OptGo                = 7
	OptStructuredReply   = 8
	OptListMetaContext   = 9
	OptSetMetaContext    = 10
	OptExtendedHeaders   = 11
	RepFlagError         = 1 << 31
	RepAck               = 1
	RepServer            = 2
	RepInfo              = 3
	RepMetaContext       = 4
	RepErrUnsup          = RepFlagError | 1
	RepErrPolicy         = RepFlagError | 2
	RepErrInvalid        = RepFlagError | 3
	RepErrPlatform       = RepFlagError | 4
	RepErrTLSReqd        = RepFlagError | 5
	RepErrUnknown        = RepFlagError | 6
	RepErrShutdown       = RepFlagError | 7
	RepErrBlockSizeReqd  = RepFlagError | 8
	RepErrTooBig         = RepFlagError | 9
	RepErrExtHeaderReqd  = RepFlagError | 10
	InfoExport           = 0
	InfoName             = 1
	InfoDescription      = 2
	InfoBlockSize        = 3
	InfoExportPayloadLen = 2 + 8 + 2
	InfoBlockPayloadLen  = 2 + 4 + 4 + 4
)

// Transmission flags, proto.md "Transmission flags".
const (
	TflagHasFlags         = 1 << 0
	TflagReadOnly         = 1 << 1
	TflagSendFlush        = 1 << 2
	TflagSendFUA          = 1 << 3
	TflagRotational       = 1 << 4
	TflagSendTrim         = 1 << 5
	TflagSendWriteZeroes  = 1 << 6
	TflagSendDF           = 1 << 7
	TflagCanMultiConn     = 1 << 8
	TflagSendResize       = 1 << 9
	TflagSendCache        = 1 << 10
	TflagSendFastZero     = 1 << 11
	TflagBlockStatPayload = 1 << 12
)

// Commands and command flags, proto.md "Request types", "Command flags".
const (
	CmdRead        = 0
	CmdWrite       = 1
	CmdDisc        = 2
	CmdFlush       = 3
	CmdTrim        = 4
	CmdCache       = 5
	CmdWriteZeroes = 6
	CmdBlockStatus = 7

	CmdFlagFUA      = 1 << 0
	CmdFlagNoHole   = 1 << 1
	CmdFlagDF       = 1 << 2
	CmdFlagReqOne   = 1 << 3
	CmdFlagFastZero = 1 << 4
	// CmdFlagPayloadLen: with extended headers, the length field is a payload length.
	CmdFlagPayloadLen = 1 << 5
)

// Structured reply flags and chunk types, proto.md "Structured reply types".
const (
	ReplyFlagDone        = 1 << 0
	ChunkNone            = 0
	ChunkOffsetData      = 1
	ChunkOffsetHole      = 2
	ChunkBlockStatus     = 5
	ChunkBlockStatusExt  = 6
	ChunkError           = 1<<15 | 1
	ChunkErrorOffset     = 1<<15 | 2
	ChunkErrorPayloadLen = 4 + 2 // error, message length
)

// Metadata context "base:allocation", proto.md "Metadata querying" and "base:allocation
// metadata context": the status flags of an extent.
const (
	MetaBaseAllocation = "base:allocation"
	StateHole          = 1 << 0
	StateZero          = 1 << 1
)

// Error values, proto.md "Error values".
const (
	EPerm     = 1
	EIO       = 5
	ENoMem    = 12
	EInval    = 22
	ENoSpc    = 28
	EOverflow = 75
	ENotSup   = 95
	EShutdown = 108
)
