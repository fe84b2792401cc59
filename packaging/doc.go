// Package packaging holds what eli's Debian package installs besides the binary (the
// systemd targets, the udev rule, the commented /etc/elitab), which scripts/deb puts
// together; its test builds the package and installs it into a scratch root.
package packaging
