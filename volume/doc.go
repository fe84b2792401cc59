// Package volume runs an attached eli volume: it opens an unlocked provider as a Volume,
// which is what the NBD server serves, and runs the Server that serves it on a unix
// socket, on TCP with TLS, and through the kernel's NBD device, until it is shut down.
// Who may use a provider is decided by the Handle OpenProvider returns.
//
// The eli command is flags and messages around this package:
//
//	srv, err := volume.Listen(cfg, log)   // sockets first: nothing touched yet
//	v, err := volume.Open(p, mk, cfg.Options(log))
//	err = srv.Start(v)                    // clients can connect
//	err = srv.Wait(ctx)
//	err = srv.Shutdown(ctx)               // the final commit's outcome
//
// or the first three at once in Start. eli's background server, its state directory and
// its control socket are package internal/daemon's.
//
// Volume is also the one place where nbd and blockdev meet: it translates nbd's request
// flags to blockdev's by name, and a read that fails in one sector (blockdev.SectorError)
// to an nbd.OffsetError, so that the client learns the sector's offset.
package volume
