package main

// eli as a system service: the sd_notify messages of 'attach --foreground', the
// generator run under its own name, 'eli elitab', and the man pages.

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/elidisk/eli/internal/elitest"
)

// TestForegroundNotifiesSystemd: under a Type=notify service, READY=1 comes once the
// export serves (a client connects at that moment), STOPPING=1 once asked to stop.
func TestForegroundNotifiesSystemd(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.initVolume("n.img", "16M")
	sock := filepath.Join(e.Dir, "notify") // as short as the state directory's sockets
	l, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cmd := e.Command("attach", "--foreground", "--passphrase-file", e.Pass, "--name", "n", img)
	cmd.Env = append(cmd.Env, "NOTIFY_SOCKET="+sock)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	receive := func() string {
		l.SetReadDeadline(time.Now().Add(60 * time.Second))
		buf := make([]byte, 4096)
		n, err := l.Read(buf)
		if err != nil {
			t.Fatalf("no notification: %v; eli said: %s", err, stderr.String())
		}
		return string(buf[:n])
	}
	msg := receive()
	socket := filepath.Join(e.State, "n.sock")
	if !strings.HasPrefix(msg, "READY=1\nSTATUS=serving nbd+unix:///?socket="+socket+"\n") {
		t.Fatalf("first notification %q", msg)
	}
	dial(t, socket) // ready means a client gets in
	cmd.Process.Signal(syscall.SIGTERM)
	if msg := receive(); msg != "STOPPING=1\n" {
		t.Errorf("second notification %q, want STOPPING=1", msg)
	}
	if err := cmd.Wait(); err != nil {
		t.Errorf("the server's exit: %v; it said: %s", err, stderr.String())
	}
}

const testTable = `# a test table
data  /dev/disk/by-id/ata-X   /etc/eli/data.key
home  /srv/home.img           cred:home.key        nofail,device=none
bad   /dev/sdb1               -                    nofial
remote nbds://st/vol          -                    _netdev
`

// TestGeneratorByName: eli run as eli-generator writes the units of the good lines of
// the table into the first directory and reports a bad line with its file, line and
// field, without failing (the other volumes must attach).
func TestGeneratorByName(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	table := e.Write("elitab", testTable)
	gen := filepath.Join(t.TempDir(), "eli-generator")
	if err := os.Symlink(eliBin, gen); err != nil {
		t.Fatal(err)
	}
	normal, early, late := t.TempDir(), t.TempDir(), t.TempDir()
	r := runGen(t, gen, []string{"ELI_ELITAB=" + table}, normal, early, late)
	if r.Code != 0 {
		t.Fatalf("generator: %v", r)
	}
	want := "eli-generator: " + table + `:4: options: unknown option "nofial" (elitab(5) lists them); this line is skipped` + "\n"
	if r.Stderr != want {
		t.Errorf("generator's messages:\n%s\nwant:\n%s", r.Stderr, want)
	}
	for _, f := range []string{"eli@data.service", "eli@home.service", "eli@remote.service", "eli.target.requires/eli@data.service",
		"eli.target.wants/eli@home.service", "remote-eli.target.requires/eli@remote.service", "dev-eli-data.device.requires/eli@data.service"} {
		if _, err := os.Lstat(filepath.Join(normal, f)); err != nil {
			t.Errorf("generator did not write %s: %v", f, err)
		}
	}
	unit, _ := os.ReadFile(filepath.Join(normal, "eli@data.service"))
	if !strings.Contains(string(unit), "ExecStart="+eliBin+" attach --foreground --name data") {
		t.Errorf("the unit does not run this binary:\n%s", unit)
	}
	if _, err := os.Stat(filepath.Join(normal, "eli@bad.service")); err == nil {
		t.Error("the malformed line got a unit")
	}
	for _, d := range []string{early, late} {
		if ents, _ := os.ReadDir(d); len(ents) != 0 {
			t.Errorf("generator wrote into %s", d)
		}
	}
	// One directory stands for all three; none is a usage error. No table: no units.
	if r := runGen(t, gen, []string{"ELI_ELITAB=" + filepath.Join(t.TempDir(), "none")}, t.TempDir()); r.Code != 0 || r.Stderr != "" {
		t.Errorf("generator without a table: %v", r)
	}
	if r := runGen(t, gen, nil); r.Code != 2 || !strings.Contains(r.Stderr, "usage: eli-generator NORMAL-DIR") {
		t.Errorf("generator without directories: %v", r)
	}
}

// runGen runs bin (the generator's link) with env added to the environment.
func runGen(t *testing.T, bin string, env []string, args ...string) elitest.Result {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	return runCmd(t, cmd)
}

// TestGeneratedUnitRuns runs what a generated unit's ExecStart= says, as systemd would
// (a notify socket, the credential directory LoadCredential= fills): the command line the
// generator writes is one the real eli takes, and it serves.
func TestGeneratedUnitRuns(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := e.Write("vol.key", "the volume's key")
	img := e.Path("vol.img")
	e.OK(append(append([]string{"init", "--size", "16M", "--keyfile", key, "--no-passphrase"}, elitest.QuickKDF...), img)...)
	creds := t.TempDir()
	os.WriteFile(filepath.Join(creds, "vol.key"), []byte("the volume's key"), 0o400)
	table := e.Write("elitab", "byfile "+img+" "+key+" device=none\nbycred "+img+" cred:vol.key device=none,readonly\n")
	gen := filepath.Join(t.TempDir(), "eli-generator")
	if err := os.Symlink(eliBin, gen); err != nil {
		t.Fatal(err)
	}
	units := t.TempDir()
	if r := runGen(t, gen, []string{"ELI_ELITAB=" + table}, units); r.Code != 0 || r.Stderr != "" {
		t.Fatalf("generator: %v", r)
	}
	for _, name := range []string{"byfile", "bycred"} {
		unit, err := os.ReadFile(filepath.Join(units, "eli@"+name+".service"))
		if err != nil {
			t.Fatal(err)
		}
		var argv []string
		for _, line := range strings.Split(string(unit), "\n") {
			if cmdline, ok := strings.CutPrefix(line, "ExecStart="); ok {
				if strings.ContainsAny(cmdline, `"%$\`) {
					t.Fatalf("this test splits plain command lines only: %s", cmdline)
				}
				argv = strings.Fields(cmdline)
			}
		}
		if len(argv) == 0 || argv[0] != eliBin {
			t.Fatalf("no ExecStart= running this eli in:\n%s", unit)
		}
		sock := filepath.Join(e.Dir, "notify-"+name)
		l, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
		if err != nil {
			t.Fatal(err)
		}
		cmd := e.Command(argv[1:]...)
		cmd.Env = append(cmd.Env, "NOTIFY_SOCKET="+sock, "CREDENTIALS_DIRECTORY="+creds)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		l.SetReadDeadline(time.Now().Add(60 * time.Second))
		buf := make([]byte, 4096)
		n, err := l.Read(buf)
		if err != nil || !strings.HasPrefix(string(buf[:n]), "READY=1\n") {
			cmd.Process.Kill()
			t.Fatalf("%s: no READY: %q, %v; eli said: %s", name, buf[:n], err, stderr.String())
		}
		dial(t, filepath.Join(e.State, name+".sock"))
		cmd.Process.Signal(syscall.SIGTERM)
		if err := cmd.Wait(); err != nil {
			t.Errorf("%s: %v; eli said: %s", name, err, stderr.String())
		}
		l.Close()
	}
}

func TestElitabCommand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	table := e.Write("elitab", testTable)
	units := t.TempDir()
	r := e.Run("", "elitab", "--file", table, "--units", units)
	if r.Code != 1 {
		t.Fatalf("a table with a bad line: %v", r)
	}
	for _, want := range []string{
		table + ":2: eli@data.service: /dev/disk/by-id/ata-X, keyfile /etc/eli/data.key, device /dev/eli/data (a free /dev/nbdN)\n",
		table + ":3: eli@home.service: /srv/home.img, credential home.key, export only (no kernel device), nofail\n",
		table + ":5: eli@remote.service: nbds://st:10809/vol, passphrase asked at boot (3 tries, 1m30s each), device /dev/eli/remote (a free /dev/nbdN), _netdev\n",
	} {
		if !strings.Contains(r.Stdout, want) {
			t.Errorf("eli elitab does not say %q:\n%s", want, r.Stdout)
		}
	}
	if !strings.Contains(r.Stderr, table+`:4: options: unknown option "nofial"`) {
		t.Errorf("eli elitab's stderr: %s", r.Stderr)
	}
	if _, err := os.Stat(filepath.Join(units, "eli@remote.service")); err != nil {
		t.Errorf("--units: %v", err)
	}
	good := e.Write("good", "data /dev/sdb1 /etc/k\n")
	if r := e.Run("", "elitab", "--file", good); r.Code != 0 {
		t.Errorf("a good table: %v", r)
	}
}

func TestManPages(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := filepath.Join(t.TempDir(), "man")
	e.OK("man-pages", dir)
	for _, page := range []string{"eli.8", "eli-attach.8", "eli-detach.8", "eli-elitab.8", "eli-init.8", "eli-completion-bash.8", "elitab.5"} {
		b, err := os.ReadFile(filepath.Join(dir, page))
		if err != nil {
			t.Errorf("no %s: %v", page, err)
			continue
		}
		if !strings.HasPrefix(string(b), ".nh\n.TH ") && !strings.HasPrefix(string(b), ".TH ") {
			t.Errorf("%s does not start as a man page: %.80q", page, b)
		}
	}
	ents, _ := os.ReadDir(dir)
	for _, ent := range ents {
		if strings.Contains(ent.Name(), "serve") || strings.Contains(ent.Name(), "man-pages") {
			t.Errorf("a hidden command has a page: %s", ent.Name())
		}
	}
	attach, _ := os.ReadFile(filepath.Join(dir, "eli-attach.8"))
	for _, want := range []string{"--key-command", "--credential", "--ask-password", "--foreground"} {
		if !strings.Contains(string(attach), want) && !strings.Contains(string(attach), strings.ReplaceAll(want, "-", `\-`)) {
			t.Errorf("eli-attach(8) lacks %s", want)
		}
	}
	tab, _ := os.ReadFile(filepath.Join(dir, "elitab.5"))
	if !strings.Contains(string(tab), `.TH ELITAB 5`) || !strings.Contains(string(tab), "keyscript") {
		t.Errorf("elitab(5): %.200q", tab)
	}
}
