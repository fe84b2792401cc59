// Command eli creates, attaches and manages encrypted block devices served over NBD, in
// the spirit of FreeBSD's geli(8). See README.md and `eli help`.
package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
)

// Exit codes, as docs/design.md fixes them.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

// usageError marks an error as the caller's misuse of the command line (exit code 2).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// silentError fails the command without a message: what it had to say is said.
type silentError struct{ err error }

func (e silentError) Error() string { return e.err.Error() }
func (e silentError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// globalOptions are flags every command shares.
type globalOptions struct {
	stateDir string
	verbose  bool
}

func newRootCmd() *cobra.Command {
	g := &globalOptions{}
	root := &cobra.Command{
		Use:   "eli",
		Short: "Encrypted block devices served over NBD",
		Long: `eli encrypts a provider (a file, a block device, or a remote NBD export named by a
URI: nbd://HOST[:PORT]/EXPORT, nbds://... with ?tls-certificates=DIR, nbd+unix:///EXPORT?socket=PATH)
sector by sector and serves
the plaintext view as an NBD export that the Linux kernel, qemu, libnbd tools and
fio can use. The default mode, xchacha20-poly1305, seals every sector under a fresh
random nonce on every write and turns tampering into an I/O error.

Start with 'eli init PROVIDER', then 'eli attach PROVIDER'; 'eli detach NAME' closes it.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		CompletionOptions: cobra.CompletionOptions{
			HiddenDefaultCmd: false,
		},
	}
	root.PersistentFlags().StringVar(&g.stateDir, "state-dir", "",
		"directory for sockets and state of attached volumes (default /run/eli for root, $XDG_RUNTIME_DIR/eli otherwise; env ELI_STATE_DIR)")
	root.PersistentFlags().BoolVarP(&g.verbose, "verbose", "v", false, "log more detail to stderr")
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return usageError{fmt.Errorf("%w (see '%s --help')", err, c.CommandPath())}
	})
	root.AddCommand(
		newInitCmd(g),
		newAttachCmd(g),
		newDetachCmd(g),
		newSuspendCmd(g),
		newResumeCmd(g),
		newListCmd(g),
		newStatusCmd(g),
		newDumpCmd(g),
		newSetkeyCmd(g),
		newDelkeyCmd(g),
		newKillCmd(g),
		newBackupCmd(g),
		newRestoreCmd(g),
		newOnetimeCmd(g),
		newResizeCmd(g),
		newReencryptCmd(g),
		newVersionCmd(),
		newBenchCmd(),
		newDemoCmd(g),
		newElitabCmd(),
		newManCmd(),
		newServeCmd(g),
	)
	return root
}

// exactArgs is cobra.ExactArgs with a usage error and a message that names the arguments.
func exactArgs(names ...string) cobra.PositionalArgs {
	return func(c *cobra.Command, args []string) error {
		if len(args) != len(names) {
			return usagef("%s takes %d argument(s): %v, got %d (see '%s --help')",
				c.Name(), len(names), names, len(args), c.CommandPath())
		}
		return nil
	}
}

func main() {
	if filepath.Base(os.Args[0]) == generatorName {
		os.Exit(runGenerator(os.Args[1:]))
	}
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	root := newRootCmd()
	root.SetArgs(args)
	cmd, err := root.ExecuteC()
	if err == nil {
		return exitOK
	}
	err = explain(err)
	if errors.As(err, &silentError{}) {
		return exitError
	}
	fmt.Fprintf(os.Stderr, "eli: %v\n", err)
	var ue usageError
	if errors.As(err, &ue) || isCobraUsageError(cmd, err) {
		return exitUsage
	}
	return exitError
}

// isCobraUsageError catches the errors cobra raises itself before a command runs
// (unknown command, bad arguments), which do not pass through our wrappers.
func isCobraUsageError(cmd *cobra.Command, err error) bool {
	if cmd == nil {
		return true
	}
	msg := err.Error()
	for _, p := range []string{"unknown command", "unknown flag", "unknown shorthand", "accepts ", "requires at least", "invalid argument", "flag needs an argument", "required flag"} {
		if strings.Contains(msg, p) {
			return true
		}
	}
	return false
}
