// Package nbd is the server side of the Network Block Device protocol, as specified in
// NetworkBlockDevice/nbd doc/proto.md. It knows nothing of encryption: it serves any
// Backend, and every backend error becomes that request's error reply.
//
// What it speaks:
//
//   - Handshake: fixed newstyle, and plain newstyle for NBD_OPT_EXPORT_NAME.
//     NBD_OPT_EXPORT_NAME, NBD_OPT_GO, NBD_OPT_INFO (with NBD_INFO_EXPORT, NAME,
//     DESCRIPTION and BLOCK_SIZE), NBD_OPT_LIST, NBD_OPT_ABORT, NBD_OPT_STRUCTURED_REPLY,
//     NBD_OPT_EXTENDED_HEADERS, NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT
//     (the one context is base:allocation) and NBD_OPT_STARTTLS; any other option gets
//     NBD_REP_ERR_UNSUP and the session goes on, and during Shutdown every option but
//     ABORT gets NBD_REP_ERR_SHUTDOWN. With a TLS config the server is FORCEDTLS.
//   - Transmission: READ, WRITE, FLUSH, TRIM, WRITE_ZEROES (NO_HOLE, FAST_ZERO), CACHE,
//     BLOCK_STATUS (REQ_ONE; from the backend's BlockStatuser, else all data) and DISC,
//     with simple, structured or extended replies (a read is one data chunk, or an error
//     chunk with a message). With extended headers, lengths are 64 bits (TRIM,
//     WRITE_ZEROES, CACHE and BLOCK_STATUS can span the export). Requests on a connection
//     run concurrently and are answered out of order.
//
// Bounds: option data is read into at most 8 KiB (up to 64 KiB is skipped for an option
// the server refuses, more ends the connection); export names and messages are limited to
// the protocol's 4096 bytes; READ and WRITE carry at most the export's maximum block size
// (by default MaxRequest, 64 MiB), and a WRITE announcing more is refused after its
// payload is skipped, up to 256 MiB (more ends the connection; with extended headers, any
// payload above the maximum ends it, as proto.md asks); offsets are checked for overflow
// and against the export's size and block sizes before the backend sees them. Requests in
// flight are bounded per connection and per server, in count and in payload bytes
// (Server's Max* fields). Each connection has a small reserve of its own, and a request
// larger than the reserve that finds the shared pool full is served in pieces under it
// (stream.go), so that what other clients hold, stalled or not, delays no request; payloads
// and replies have deadlines. Connections, handshakes, connections per address and
// handshake time are bounded too.
//
// Use:
//
//	l, err := nbd.ListenUnix(path) // mode 0600
//	srv := &nbd.Server{Exports: []nbd.Export{{Name: "", Backend: dev, MultiConn: true}}}
//	go srv.Serve(l)
//	...
//	srv.Shutdown(ctx) // on SIGTERM: drain, flush, close
package nbd
