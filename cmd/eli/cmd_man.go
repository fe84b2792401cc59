package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cpuguy83/go-md2man/v2/md2man"
	"github.com/elidisk/eli/elitab"
	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"
)

// newManCmd writes the man pages (hidden: the package build runs it): eli(8) and one
// page per command from the commands' own help, and elitab(5) from its Markdown.
func newManCmd() *cobra.Command {
	var date string
	cmd := &cobra.Command{
		Use:    "man-pages DIR",
		Short:  "Write eli's man pages into DIR",
		Hidden: true,
		Args:   exactArgs("DIR"),
		RunE: func(cmd *cobra.Command, args []string) error {
			// A fixed date keeps a package build reproducible (SOURCE_DATE_EPOCH).
			when := time.Unix(0, 0).UTC()
			if date != "" {
				t, err := time.Parse(time.DateOnly, date)
				if err != nil {
					return usagef("--date: %v", err)
				}
				when = t
			}
			return writeManPages(args[0], when)
		},
	}
	cmd.Flags().StringVar(&date, "date", "", "the date the pages carry (YYYY-MM-DD)")
	return cmd
}

func writeManPages(dir string, when time.Time) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	root := newRootCmd()
	root.DisableAutoGenTag = true
	root.InitDefaultCompletionCmd() // cobra adds it when a command runs, not before
	manLong(root)
	hdr := &doc.GenManHeader{Section: "8", Date: &when, Source: "eli " + version, Manual: "eli manual"}
	if err := doc.GenManTree(root, hdr, dir); err != nil {
		return fmt.Errorf("man pages: %w", err)
	}
	return os.WriteFile(filepath.Join(dir, "elitab.5"), md2man.Render([]byte(elitab.ManPage)), 0o644)
}

// manLong makes the commands' help texts Markdown that reads as it does on a terminal:
// their indented lines (tables of options, commands) become literal blocks, which
// Markdown would otherwise run into the paragraph around them.
func manLong(c *cobra.Command) {
	var b strings.Builder
	inBlock := false
	for _, line := range strings.Split(c.Long, "\n") {
		indented := strings.HasPrefix(line, "  ")
		switch {
		case indented && !inBlock:
			b.WriteString("\n")
			inBlock = true
		case !indented && inBlock && line != "":
			b.WriteString("\n")
			inBlock = false
		}
		if indented {
			b.WriteString("    ")
		}
		b.WriteString(line + "\n")
	}
	c.Long = strings.TrimSuffix(b.String(), "\n")
	for _, sub := range c.Commands() {
		manLong(sub)
	}
}
