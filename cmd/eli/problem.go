package main

import (
	"fmt"
	"time"

	"github.com/elidisk/eli/volume"
)

// problem is one line saying what failed in the status s and what state the data is in
// ("" when nothing failed): the data first, then a witness that does not hold the
// latest state.
func problem(s *volume.Status) string {
	if !s.Failed() {
		if s.Witness != "" {
			return fmt.Sprintf("%s: the data is safe, but %s", s.Name, s.Witness)
		}
		return ""
	}
	finalFailed := s.Final != "" && s.Final != "ok"
	var what string
	switch {
	case s.Error != "" && finalFailed && s.Final != s.Error:
		what = "the provider failed while serving (" + s.Error + "), and the final commit and flush failed too: " + s.Final
	case s.Error != "" && finalFailed:
		what = "the provider failed while serving, so the final commit could not be made: " + s.Error
	case s.Error != "":
		what = "the provider failed: " + s.Error
	default:
		what = "the final commit and flush failed: " + s.Final
	}
	flushed := "what was flushed before the failure is safe"
	if !s.LastFlush.IsZero() {
		flushed += " (the last flush completed at " + s.LastFlush.Format(time.TimeOnly) + ")"
	}
	var data string
	if s.Authenticated {
		data = flushed + "; writes since then may be lost, " +
			"and the next attach rolls the journal forward or back to a consistent volume"
	} else {
		data = flushed + "; writes since then may be lost " +
			"or partly written (this mode has no journal)"
	}
	msg := fmt.Sprintf("%s: %s; %s", s.Name, what, data)
	if s.Witness != "" {
		msg += "; and " + s.Witness
	}
	return msg
}
