// Package vm builds what the VM test boots: the list of kernel modules to load (with
// their dependencies, from each module's .modinfo) and a gzip'd newc initramfs holding
// busybox, eli, the modules, a few dynamically linked tools and their libraries.
package vm

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// ModInfo is the part of a module's .modinfo section the loader needs.
type ModInfo struct {
	Depends []string // depends=: modules that must be loaded first
	SoftPre []string // softdep=pre: ...: modules it asks for by name at runtime (crc32c)
}

// ReadModInfo parses the .modinfo section of a .ko file.
func ReadModInfo(ko string) (ModInfo, error) {
	f, err := elf.Open(ko)
	if err != nil {
		return ModInfo{}, err
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return ModInfo{}, fmt.Errorf("%s: no .modinfo section", ko)
	}
	data, err := sec.Data()
	if err != nil {
		return ModInfo{}, fmt.Errorf("%s: %w", ko, err)
	}
	return parseModInfo(data), nil
}

// parseModInfo reads NUL-separated key=value strings.
func parseModInfo(data []byte) ModInfo {
	var mi ModInfo
	for _, kv := range bytes.Split(data, []byte{0}) {
		k, v, ok := strings.Cut(string(kv), "=")
		if !ok {
			continue
		}
		switch k {
		case "depends":
			for _, d := range strings.Split(v, ",") {
				if d = strings.TrimSpace(d); d != "" {
					mi.Depends = append(mi.Depends, modName(d))
				}
			}
		case "softdep":
			// "pre: a b post: c"
			pre := false
			for _, w := range strings.Fields(v) {
				switch {
				case w == "pre:":
					pre = true
				case strings.HasSuffix(w, ":"):
					pre = false
				case pre:
					mi.SoftPre = append(mi.SoftPre, modName(w))
				}
			}
		}
	}
	return mi
}

// modName is the kernel's spelling of a module name: '-' and '_' are the same.
func modName(s string) string {
	return strings.ReplaceAll(strings.TrimSuffix(path.Base(s), ".ko"), "-", "_")
}

// Resolve returns the .ko files under root needed to load names, each after its
// dependencies. Soft pre-dependencies are loaded too when the tree has them (ext4 and
// jbd2 ask for crc32c by name, which only a loaded crc32c module can answer).
func Resolve(root string, names []string) ([]string, error) {
	index := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".ko") {
			index[modName(p)] = p
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var order []string
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(name string, soft bool) error
	visit = func(name string, soft bool) error {
		switch state[name] {
		case 1:
			return fmt.Errorf("module dependency cycle at %s", name)
		case 2:
			return nil
		}
		ko, ok := index[name]
		if !ok {
			if soft {
				return nil
			}
			return fmt.Errorf("module %s not found under %s", name, root)
		}
		state[name] = 1
		mi, err := ReadModInfo(ko)
		if err != nil {
			return err
		}
		for _, d := range mi.Depends {
			if err := visit(d, false); err != nil {
				return err
			}
		}
		for _, d := range mi.SoftPre {
			if err := visit(d, true); err != nil {
				return err
			}
		}
		state[name] = 2
		order = append(order, ko)
		return nil
	}
	for _, n := range names {
		if err := visit(modName(n), false); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// Initramfs accumulates the files of a newc cpio archive.
type Initramfs struct {
	entries map[string]entry
}

type entry struct {
	mode   uint32 // full st_mode
	data   []byte
	target string // symlinks
}

const (
	modeDir     = 0o040000
	modeFile    = 0o100000
	modeSymlink = 0o120000
)

func (r *Initramfs) add(name string, e entry) {
	if r.entries == nil {
		r.entries = map[string]entry{}
	}
	name = strings.TrimPrefix(path.Clean("/"+name), "/")
	for d := path.Dir(name); d != "." && d != "/"; d = path.Dir(d) {
		if _, ok := r.entries[d]; !ok {
			r.entries[d] = entry{mode: modeDir | 0o755}
		}
	}
	r.entries[name] = e
}

// File adds a file with the given permission bits.
func (r *Initramfs) File(name string, data []byte, perm uint32) {
	r.add(name, entry{mode: modeFile | perm&0o7777, data: data})
}

// Symlink adds name pointing at target.
func (r *Initramfs) Symlink(name, target string) {
	r.add(name, entry{mode: modeSymlink | 0o777, target: target})
}

// Dir adds an empty directory.
func (r *Initramfs) Dir(name string) { r.add(name, entry{mode: modeDir | 0o755}) }

// CopyFile adds the host file src (symlinks followed) as name, keeping its permissions.
func (r *Initramfs) CopyFile(name, src string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	st, err := os.Stat(src)
	if err != nil {
		return err
	}
	r.File(name, data, uint32(st.Mode().Perm()))
	return nil
}

var lddRE = regexp.MustCompile(`(?:=>\s*)?(/\S+)\s+\(0x`)

// CopyProgram adds the host program at src as name, with every shared library ldd lists
// at its host path (the guest then runs it with the host's loader).
func (r *Initramfs) CopyProgram(name, src string) error {
	if err := r.CopyFile(name, src); err != nil {
		return err
	}
	out, err := exec.Command("ldd", src).Output()
	if err != nil {
		// "not a dynamic executable": nothing more to copy.
		return nil
	}
	for _, m := range lddRE.FindAllStringSubmatch(string(out), -1) {
		if err := r.CopyFile(m[1], m[1]); err != nil {
			return fmt.Errorf("library of %s: %w", src, err)
		}
	}
	return nil
}

// WriteTo writes the archive, gzip-compressed, in the newc format the kernel unpacks
// (Documentation/driver-api/early-userspace/buffer-format.rst).
func (r *Initramfs) WriteTo(w io.Writer) (int64, error) {
	zw, err := gzip.NewWriterLevel(w, gzip.BestSpeed)
	if err != nil {
		return 0, err
	}
	names := make([]string, 0, len(r.entries))
	for n := range r.entries {
		names = append(names, n)
	}
	sort.Strings(names) // parents before children
	cw := &countWriter{w: zw}
	ino := uint32(1)
	for _, n := range names {
		e := r.entries[n]
		body := e.data
		if e.mode&0o170000 == modeSymlink {
			body = []byte(e.target)
		}
		if err := writeNewc(cw, ino, e.mode, n, body); err != nil {
			return cw.n, err
		}
		ino++
	}
	if err := writeNewc(cw, ino, 0, "TRAILER!!!", nil); err != nil {
		return cw.n, err
	}
	if err := zw.Close(); err != nil {
		return cw.n, err
	}
	return cw.n, nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func pad4(w io.Writer, n int64) error {
	if r := n % 4; r != 0 {
		_, err := w.Write(make([]byte, 4-r))
		return err
	}
	return nil
}

func writeNewc(w *countWriter, ino, mode uint32, name string, body []byte) error {
	nlink := 1
	if mode&0o170000 == modeDir {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		ino, mode, 0, 0, nlink, 0, len(body), 0, 0, 0, 0, len(name)+1, 0)
	if _, err := io.WriteString(w, hdr+name+"\x00"); err != nil {
		return err
	}
	if err := pad4(w, w.n); err != nil {
		return err
	}
	if _, err := w.Write(body); err != nil {
		return err
	}
	return pad4(w, w.n)
}
