package nbdclient

// maxSpans bounds the ranges kept to track writes that a reconnection may have lost;
// past it, the ranges are merged into one that covers them all (which errs on the side of
// reporting a loss).
const maxSpans = 1 << 14

// span is the byte range [off, end) of a write, with its acknowledgement order.
type span struct {
	off, end uint64
	ackSeq   uint64
}

// unkeptSpans are acknowledged writes that are neither flushed nor in the replay log, in
// acknowledgement order.
type unkeptSpans []span

func (u *unkeptSpans) add(s span) {
	*u = append(*u, s)
	if len(*u) > maxSpans {
		all := span{off: (*u)[0].off, end: (*u)[0].end, ackSeq: s.ackSeq}
		for _, x := range *u {
			all.off, all.end = min(all.off, x.off), max(all.end, x.end)
		}
		*u = append((*u)[:0], all)
	}
}

// flushed drops the writes a FLUSH covered.
func (u *unkeptSpans) flushed(mark uint64) {
	i := 0
	for i < len(*u) && (*u)[i].ackSeq <= mark {
		i++
	}
	*u = append((*u)[:0], (*u)[i:]...)
}

// lostSpans are ranges whose acknowledged data a reconnection may have lost and that no
// acknowledged write has covered since.
type lostSpans []span

func (l *lostSpans) add(off, end uint64) {
	*l = append(*l, span{off: off, end: end})
	if len(*l) > maxSpans {
		all := (*l)[0]
		for _, x := range *l {
			all.off, all.end = min(all.off, x.off), max(all.end, x.end)
		}
		*l = append((*l)[:0], all)
	}
}

// rewritten removes [off, end) from the lost ranges: new data is there now.
func (l *lostSpans) rewritten(off, end uint64) {
	if len(*l) == 0 {
		return
	}
	out := (*l)[:0:0]
	for _, x := range *l {
		if x.end <= off || end <= x.off {
			out = append(out, x)
			continue
		}
		if x.off < off {
			out = append(out, span{off: x.off, end: off})
		}
		if end < x.end {
			out = append(out, span{off: end, end: x.end})
		}
	}
	*l = out
	if len(*l) > maxSpans {
		l.add((*l)[0].off, (*l)[0].end) // merges
	}
}
