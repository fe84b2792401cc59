// Package sysvm boots a real Debian 12 userspace with systemd as PID 1 under qemu (TCG)
// for tests that need a whole system: units, fstab, generators, the journal, reboots
// and power cuts.
//
// The guest runs Debian's 6.1 kernel and a root file system built with mmdebstrap
// (rootfs.packages), both cached by scripts/test in CacheDir. A busybox initramfs loads
// the root disk's drivers, mounts it and switch_roots to systemd. Every disk is a Disk:
// a host file of durable contents under a volatile write cache, served over NBD, so the
// guest's flushes reach it and a power cut loses what a real disk would.
//
// A test talks to the guest through an agent (a systemd service started before
// sysinit.target, reached over a virtio-serial port) that runs bash scripts as root:
//
//	m := sysvm.NewTest(t, sysvm.TestOptions{
//		Disks: []sysvm.DiskSpec{{Name: "data", Size: 256 << 20}}, // /dev/disk/by-id/virtio-data
//		Root:  sysvm.RootOptions{Files: []sysvm.File{{Path: "/root/x.deb", Src: deb}}},
//	})
//	info, err := m.Boot(ctx)                  // until systemctl is-system-running --wait
//	r, err := m.Run(ctx, "dpkg -i /root/x.deb") // r.RC, r.Stdout, r.Stderr
//	info, err = m.Reboot(ctx)                 // systemctl reboot, then the next boot
//	cut, err := m.PowerCutWhen(ctx, func(unflushed map[string]int) bool {
//		return unflushed["data"] > 0          // mid-write
//	}, sysvm.LoseRandom, rng)
//	info, err = m.Boot(ctx)                   // journal recovery, fsck, mounts
//	at, err := m.UnitTimes(ctx, "local-fs.target") // since the kernel started
//
// The console of each boot is kept (Console, ConsolePath); journalctl -b -1 reads the
// previous boot's journal, which is persistent.
package sysvm
