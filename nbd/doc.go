// Package nbd is the server side of the Network Block Device protocol, as specified in
// NetworkBlockDevice/nbd doc/proto.md. It knows nothing of encryption: it serves any
// Backend, and every backend error becomes that request's error reply.
//
// What it speaks:
//
//   - Handshake: fixed newstyle only. NBD_OPT_EXPORT_NAME, NBD_OPT_GO, NBD_OPT_INFO (with
//     NBD_INFO_EXPORT, NAME, DESCRIPTION and BLOCK_SIZE), NBD_OPT_LIST, NBD_OPT_ABORT,
//     NBD_OPT_STRUCTURED_REPLY and NBD_OPT_STARTTLS; any other option gets
//     NBD_REP_ERR_UNSUP and the session goes on. With a TLS config the server is
//     FORCEDTLS.
//   - Transmission: READ, WRITE, FLUSH, TRIM, WRITE_ZEROES (NO_HOLE, FAST_ZERO), CACHE and
//     DISC, with simple or structured replies (a read is one data chunk, or an error chunk
//     with a message). Requests on a connection run concurrently and are answered out of
//     order. There is no metadata context (NBD_CMD_BLOCK_STATUS is refused).
//
// Bounds: option data is read into at most 8 KiB (up to 64 KiB is skipped for an option
// the server refuses, more ends the connection); export names and messages are limited to
// the protocol's 4096 bytes; a request carries at most MaxRequest (32 MiB) and a WRITE
// announcing more ends the connection; offsets are checked for overflow and against the
// export's size and block sizes before the backend sees them. Requests in flight are
// bounded per connection and per server, in count and in payload bytes (Server's Max*
// fields), and the handshake by a timeout and a number of options.
//
// Use:
//
//	l, err := nbd.ListenUnix(path) // mode 0600
//	srv := &nbd.Server{Exports: []nbd.Export{{Name: "", Backend: dev, MultiConn: true}}}
//	go srv.Serve(l)
//	...
//	srv.Shutdown(ctx) // on SIGTERM: drain, flush, close
package nbd
