package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/elidisk/eli/elitab"
	"github.com/elidisk/eli/generator"
	"github.com/spf13/cobra"
)

// generatorName is the name under which eli is systemd's generator: the package links
// /usr/lib/systemd/system-generators/eli-generator to the eli binary.
const generatorName = "eli-generator"

// tabPath is the table the generator and 'eli elitab' read: $ELI_ELITAB (for tests and
// for trying a table out) or /etc/elitab.
func tabPath() string {
	if p := os.Getenv("ELI_ELITAB"); p != "" {
		return p
	}
	return elitab.Path
}

// runGenerator is eli run as a systemd generator (systemd.generator(7)): it writes the
// units of every good line of the table into the first output directory and reports
// each bad line, and never waits on anything but reading the table.
func runGenerator(args []string) int {
	logf := generatorLog()
	if len(args) != 1 && len(args) != 3 {
		logf(3, "usage: %s NORMAL-DIR [EARLY-DIR LATE-DIR] (systemd runs it at boot and on daemon-reload)", generatorName)
		return exitUsage
	}
	path := tabPath()
	if abs, err := filepath.Abs(path); err == nil {
		path = abs // SourcePath= takes an absolute path
	}
	vols, lineErrs, err := elitab.ReadFile(path)
	for _, le := range lineErrs {
		logf(3, "%v", le)
	}
	if err != nil {
		// What was read before the error still attaches.
		logf(3, "%v", err)
	}
	eli, xerr := os.Executable()
	if xerr != nil {
		eli = "/usr/sbin/eli"
	}
	if err := generator.Write(args[0], generator.Units(generator.Config{Eli: eli, Source: path}, vols)); err != nil {
		logf(3, "write units: %v", err)
		return exitError
	}
	return exitOK
}

// generatorLog returns where the generator's messages go: the kernel log when systemd
// runs it (generators have no journal yet, systemd.generator(7)), standard error
// otherwise. level is a syslog level (3: error).
func generatorLog() func(level int, format string, args ...any) {
	var w io.Writer = os.Stderr
	prefix := func(int) string { return generatorName + ": " }
	if os.Getenv("SYSTEMD_SCOPE") != "" {
		if kmsg, err := os.OpenFile("/dev/kmsg", os.O_WRONLY, 0); err == nil {
			w = kmsg
			prefix = func(level int) string { return fmt.Sprintf("<%d>%s[%d]: ", level, generatorName, os.Getpid()) }
		}
	}
	return func(level int, format string, args ...any) {
		// One write per message: /dev/kmsg takes each write as one record.
		io.WriteString(w, prefix(level)+strings.ReplaceAll(fmt.Sprintf(format, args...), "\n", " ")+"\n")
	}
}

func newElitabCmd() *cobra.Command {
	var file, units string
	cmd := &cobra.Command{
		Use:   "elitab",
		Short: "Check /etc/elitab, the volumes attached at boot",
		Long: `Elitab reads the boot table (/etc/elitab, or --file) as the systemd generator does
at boot, and says what each line attaches and how, or what is wrong with it (file,
line, field). It exits 1 if a line is malformed: the generator skips such a line and
attaches the others. --units DIR writes the units the generator would write, to look
at them or to check them with 'systemd-analyze verify'.

See elitab(5) for the table's format. After editing the table, 'systemctl
daemon-reload' runs the generator again.`,
		Example: `  eli elitab
  eli elitab --file ./elitab.new --units /tmp/units && systemd-analyze verify /tmp/units/*.service`,
		Args: exactArgs(),
		RunE: func(cmd *cobra.Command, args []string) error {
			if file == "" {
				file = tabPath()
			}
			vols, lineErrs, err := elitab.ReadFile(file)
			if err != nil {
				return err
			}
			if _, serr := os.Stat(file); errors.Is(serr, os.ErrNotExist) {
				warnf("%s does not exist: no volume attaches at boot", file)
			}
			out := cmd.OutOrStdout()
			for _, v := range vols {
				fmt.Fprintf(out, "%s:%d: %s: %s\n", file, v.Line, generator.UnitName(v.Name), describe(v))
			}
			if units != "" {
				abs, err := filepath.Abs(file)
				if err != nil {
					return err
				}
				eli, err := os.Executable()
				if err != nil {
					return err
				}
				if err := generator.Write(units, generator.Units(generator.Config{Eli: eli, Source: abs}, vols)); err != nil {
					return err
				}
			}
			for _, le := range lineErrs {
				fmt.Fprintln(cmd.ErrOrStderr(), "eli:", le)
			}
			if len(lineErrs) > 0 {
				return silentError{fmt.Errorf("%d malformed lines", len(lineErrs))}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&file, "file", "", "the table to read (default $ELI_ELITAB or "+elitab.Path+")")
	cmd.Flags().StringVar(&units, "units", "", "write the generated units into DIR")
	return cmd
}

// describe says in one line what a volume of the table does at boot.
func describe(v elitab.Volume) string {
	var parts []string
	parts = append(parts, v.Provider)
	switch v.Key.Kind {
	case elitab.KeyAsk:
		parts = append(parts, fmt.Sprintf("passphrase asked at boot (%d tries, %v each)", v.Tries, v.Timeout))
	case elitab.KeyFile:
		parts = append(parts, "keyfile "+v.Key.Path)
	case elitab.KeyCredential, elitab.KeyEncryptedCredential:
		s := v.Key.Kind.String() + " " + v.Key.Credential
		if v.Key.Path != "" {
			s += " from " + v.Key.Path
		}
		parts = append(parts, s)
	case elitab.KeyCommand:
		parts = append(parts, fmt.Sprintf("key command %s (%v)", strings.Join(v.Key.Command, " "), v.Timeout))
	}
	switch v.Device {
	case "":
		parts = append(parts, "export only (no kernel device)")
	case elitab.DeviceAuto:
		parts = append(parts, "device "+generator.DevicePath(v.Name)+" (a free /dev/nbdN)")
	default:
		parts = append(parts, "device "+generator.DevicePath(v.Name)+" ("+v.Device+")")
	}
	for _, f := range []struct {
		on   bool
		name string
	}{{v.ReadOnly, "read-only"}, {v.NetDev, "_netdev"}, {v.NoAuto, "noauto"}, {v.NoFail, "nofail"}} {
		if f.on {
			parts = append(parts, f.name)
		}
	}
	return strings.Join(parts, ", ")
}
