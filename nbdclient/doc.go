// Package nbdclient is eli's NBD client (NetworkBlockDevice/nbd doc/proto.md).
//
// Client is the minimal one: the fixed newstyle handshake with NBD_OPT_GO, then one
// request at a time with simple replies, on a socket that can be handed to the kernel's
// NBD driver.
//
// Remote is the client for remote storage, opened from an NBD URI (ParseURI: nbd://,
// nbds://, nbd+unix://, nbds+unix://). It negotiates TLS (NBD_OPT_STARTTLS) and structured
// replies, keeps many requests in flight on a connection (a reader goroutine matches
// replies by cookie), opens several connections when the server advertises
// NBD_FLAG_CAN_MULTI_CONN, splits requests at the export's maximum payload and refuses
// ones that break its minimum block size, and bounds memory: the bytes in flight
// (Options.MaxInFlight), the copies kept for replay (Options.ReplayLimit), and every
// length a server sends, which is checked against the request it answers before any
// byte is read into a buffer. Its method set is that of eli's provider.Provider, with
// the Punch a provider's Capabilities offer: ReadAt, WriteAt, Sync (an NBD_CMD_FLUSH,
// answered only once the server acknowledged it), Punch (NBD_CMD_WRITE_ZEROES, or
// written zeroes where the export takes none), Size and Close. Concurrent writes to
// overlapping ranges have no defined order, as on any disk and in NBD itself.
//
// Not supported: NBD_OPT_EXPORT_NAME for servers without NBD_OPT_GO, extended headers,
// block status, and TLS with pre-shared keys.
//
// # Faults and what is re-sent
//
// A connection that fails (a read or write error, a protocol violation, or a request
// that waited Options.RequestTimeout for its reply) takes the whole pool down, and a
// background goroutine redials with doubling backoff. Meanwhile calls wait, for at most
// Options.QueueTimeout in all (by default RequestTimeout; Forever holds them until the
// server is back), and then fail with EIO; the Remote serves again as soon as the
// server is back, re-sending what was in flight. SetDeadline ends every wait at a given
// time whatever QueueTimeout says (a caller shutting down). A call is never answered
// from a connection other than the one its request was last sent on, and nothing is
// re-sent until every reader of the failed pool has exited, so no late reply can land in
// a buffer. Options.Verify may check a new pool before anything is re-sent on it (that
// the export is still the one the caller was using); once it refuses, the Remote stops
// for good and every call fails with ErrExportChanged.
//
// The rule for re-sending keeps writes to one sector in an order the callers could have
// observed, and a successful Sync meaning what it says even if the server lost its
// volatile state (a restarted server process, a storage host that lost power):
//
//  1. Until a FLUSH covers it, every acknowledged write (and trim and write-zeroes) is
//     kept in a log, its data copied, in the order the server acknowledged them; a
//     successful FLUSH drops the entries acknowledged before it was sent. Writes with FUA,
//     and every write to a server that takes no FLUSH, are durable when acknowledged and
//     are not kept.
//  2. After reconnecting, and before any new request is sent, the log is rewritten in
//     acknowledgement order, then the writes that were in flight at the loss in their
//     submission order. A write is not sent while an overlapping one of the replay is
//     unanswered, because a server may execute requests in flight in any order. The
//     acknowledgement order respects every order a caller could have imposed (a caller
//     that waited for one write before issuing the next sees them acknowledged in that
//     order), and writes in flight together were concurrent, so any order among them is
//     one the caller allowed.
//  3. Then reads and FLUSHes that were in flight are re-sent; a re-sent FLUSH covers
//     every write rewritten in 2, so a Sync succeeds only once everything it covers is on
//     the new server and flushed there.
//  4. Only then do new requests go out.
//
// If the log could not keep an acknowledged unflushed write (ReplayLimit reached, or
// negative), a reconnection marks its range lost, as it does the range of a rewrite
// from the log that fails. Every Sync then fails with ErrDurability (an EIO) until
// acknowledged writes have covered all lost ranges again: any Sync covers the lost
// writes, which were acknowledged before it, so none may report them durable, whichever
// caller made them.
//
// A call that runs out of time returns EIO and is never re-sent later, so it cannot
// overwrite a write its caller makes after seeing the error; its connection is closed so
// that its reply cannot arrive either. What the network cannot promise, no client can:
// a server that keeps executing requests of a connection it has lost might apply such a
// request after a newer one from another connection.
package nbdclient
