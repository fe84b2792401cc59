package nbd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"
	"testing"
	"time"
)

// The test binary doubles as a stand-alone server process (for the SIGTERM test and the
// benchmark against nbdkit, which runs as its own process too): with NBD_TEST_SERVE set
// to "SOCKET FILE", TestMain serves FILE on SOCKET until SIGTERM instead of running tests.
func TestMain(m *testing.M) {
	if spec := os.Getenv("NBD_TEST_SERVE"); spec != "" {
		if err := helperServe(spec); err != nil {
			fmt.Fprintln(os.Stderr, "helper server:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func helperServe(spec string) error {
	var sock, file string
	if _, err := fmt.Sscan(spec, &sock, &file); err != nil {
		return fmt.Errorf("NBD_TEST_SERVE=%q: %w", spec, err)
	}
	if prof := os.Getenv("NBD_TEST_CPUPROFILE"); prof != "" {
		f, err := os.Create(prof)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	b, err := openFileBackend(file)
	if err != nil {
		return err
	}
	defer b.f.Close()
	srv := &Server{
		Exports: []Export{{Name: "", Backend: b, MultiConn: true}},
		Logger:  slog.New(slog.NewTextHandler(os.Stderr, nil)),
	}
	l, err := ListenUnix(sock)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return err
	}
	if err := <-served; !errors.Is(err, ErrServerClosed) {
		return err
	}
	return nil
}
