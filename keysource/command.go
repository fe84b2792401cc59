package keysource

import (
	"errors"
	"fmt"
	"strings"
	"syscall"
)

// SplitCommand splits a key command's text into its argv, as a shell would split a
// simple command but without a shell's expansions: words are separated by blanks;
// '...' quotes literally; "..." quotes with \" and \\ as the only escapes; a backslash
// outside quotes takes the next character literally. No globs, no variables, no
// redirections: a '$' or a '>' is an ordinary character.
func SplitCommand(s string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		case c == '\'':
			j := strings.IndexByte(s[i+1:], '\'')
			if j < 0 {
				return nil, fmt.Errorf("key command %q: a ' is not closed", s)
			}
			w.WriteString(s[i+1 : i+1+j])
			i += j + 1
			inWord = true
		case c == '"':
			i++
			for ; i < len(s) && s[i] != '"'; i++ {
				if s[i] == '\\' && i+1 < len(s) && (s[i+1] == '"' || s[i+1] == '\\') {
					i++
				}
				w.WriteByte(s[i])
			}
			if i >= len(s) {
				return nil, fmt.Errorf("key command %q: a \" is not closed", s)
			}
			inWord = true
		case c == '\\':
			if i+1 >= len(s) {
				return nil, fmt.Errorf("key command %q ends in a backslash", s)
			}
			i++
			w.WriteByte(s[i])
			inWord = true
		default:
			w.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, w.String())
	}
	if len(words) == 0 {
		return nil, errors.New("empty key command")
	}
	return words, nil
}

// JoinCommand spells argv so that SplitCommand gives it back.
func JoinCommand(argv []string) string {
	parts := make([]string, len(argv))
	for i, a := range argv {
		parts[i] = quoteWord(a)
	}
	return strings.Join(parts, " ")
}

func quoteWord(a string) string {
	if a == "" {
		return "''"
	}
	plain := true
	for i := 0; i < len(a); i++ {
		c := a[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("/._-+=:,@%", c) >= 0) {
			plain = false
			break
		}
	}
	if plain {
		return a
	}
	// Single quotes hold anything but a single quote, which goes outside them.
	return "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
}

func processGroup() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }

// killGroup kills the process group that pid leads (see processGroup).
func killGroup(pid int) { syscall.Kill(-pid, syscall.SIGKILL) }
