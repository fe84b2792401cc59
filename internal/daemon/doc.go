// Package daemon is eli's background server as a process among others: what `eli
// attach` hands the server it starts, what the server leaves where other eli commands
// find it, and its life from the first socket to the last file it removes. Package
// volume serves a volume; this package is everything around that which only the eli
// command needs.
//
//   - The state directory (StateDir): per attached volume NAME, its name lock, record,
//     status, stop request, log and sockets; listing the servers that run (List, Find)
//     and clearing what dead ones left.
//   - The attach parent/child protocol: the Setup and the master key through one pipe
//     (WriteSetup, ReadSetup), the record or the failure back through another
//     (WriteReady, ReadReady).
//   - The server's log, rotated (RotatingLog).
//   - Run: one attachment's life, with its status kept in the state directory, the
//     signals that stop it (SIGUSR1 leaves the kernel device connected), and the
//     operations it answers on its control socket (package internal/control).
package daemon
