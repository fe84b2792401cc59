// Command agent runs inside a sysvm guest as a systemd service and runs the test's
// scripts: it reads requests from a virtio-serial port, runs each with bash, and writes
// back the exit status and output. It is the guest half of sysvm's control channel
// (the protocol is in integration/sysvm/proto.go, which this file mirrors).
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// portName is the virtio-serial port's name; its device is found through sysfs, as udev
// may not have made /dev/virtio-ports/NAME yet when the agent starts.
const portName = "eli.agent"

// maxRequest bounds one request line (a script and its standard input).
const maxRequest = 256 << 20

type request struct {
	ID      uint64 `json:"id"`
	Sh      string `json:"sh"`
	Stdin   []byte `json:"stdin,omitempty"`
	Timeout int64  `json:"timeout_ms,omitempty"`
}

type reply struct {
	ID     uint64 `json:"id,omitempty"`
	Hello  string `json:"hello,omitempty"` // boot ID, sent once the port is open
	RC     int    `json:"rc"`
	Stdout []byte `json:"stdout,omitempty"`
	Stderr []byte `json:"stderr,omitempty"`
	Err    string `json:"err,omitempty"` // the script could not be run at all
}

// inflight counts the requests being run, so that a stop (SIGTERM, as at a shutdown the
// test asked for) waits for their replies.
var inflight sync.WaitGroup

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM)
	go func() {
		<-sig
		done := make(chan struct{})
		go func() { inflight.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
		}
		os.Exit(0)
	}()
	for {
		err := serve()
		fmt.Fprintf(os.Stderr, "eli-test-agent: %v; trying again\n", err)
		time.Sleep(time.Second)
	}
}

func findPort() (string, error) {
	names, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err == nil && strings.TrimSpace(string(b)) == portName {
			return "/dev/" + filepath.Base(filepath.Dir(n)), nil
		}
	}
	return "", fmt.Errorf("no virtio port named %s", portName)
}

func serve() error {
	port, err := findPort()
	if err != nil {
		return err
	}
	f, err := os.OpenFile(port, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	var wmu sync.Mutex
	send := func(r reply) {
		line, err := json.Marshal(r)
		if err != nil {
			line, _ = json.Marshal(reply{ID: r.ID, RC: -1, Err: err.Error()})
		}
		wmu.Lock()
		defer wmu.Unlock()
		f.Write(append(line, '\n'))
	}
	bootID, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	send(reply{Hello: strings.TrimSpace(string(bootID))})
	br := bufio.NewReaderSize(f, 1<<20)
	for {
		line, err := readLine(br)
		if err != nil {
			return err
		}
		var req request
		if err := json.Unmarshal(line, &req); err != nil {
			send(reply{RC: -1, Err: "bad request: " + err.Error()})
			continue
		}
		inflight.Add(1)
		go func() {
			defer inflight.Done()
			send(run(req))
		}()
	}
}

func readLine(br *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		part, err := br.ReadSlice('\n')
		line = append(line, part...)
		if len(line) > maxRequest {
			return nil, fmt.Errorf("request longer than %d bytes", maxRequest)
		}
		switch {
		case err == nil:
			return line, nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case errors.Is(err, io.EOF) && len(line) == 0:
			// The host side is not connected: wait for it.
			time.Sleep(100 * time.Millisecond)
			continue
		default:
			return nil, err
		}
	}
}

func run(req request) reply {
	ctx := context.Background()
	if req.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(req.Timeout)*time.Millisecond)
		defer cancel()
	}
	cmd := exec.CommandContext(ctx, "/bin/bash", "-c", req.Sh)
	cmd.Dir = "/root"
	cmd.Env = []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=/root", "LANG=C.UTF-8", "TERM=dumb",
	}
	cmd.Stdin = bytes.NewReader(req.Stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// Its own process group, so a timeout ends what the script started too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	// A job the script leaves in the background with our pipes open would otherwise
	// hold the reply until it ends.
	cmd.WaitDelay = 2 * time.Second
	err := cmd.Run()
	r := reply{ID: req.ID, Stdout: stdout.Bytes(), Stderr: stderr.Bytes()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		r.RC = ee.ExitCode()
		if ctx.Err() != nil {
			r.Err = fmt.Sprintf("timed out after %d ms", req.Timeout)
		}
	case errors.Is(err, exec.ErrWaitDelay):
		// Exited; a background job kept the pipes open.
		r.RC = cmd.ProcessState.ExitCode()
	default:
		r.RC = -1
		r.Err = err.Error()
	}
	return r
}
