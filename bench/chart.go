package main

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"math"
	"strings"
)

// The chart is hand-written SVG: two panels of horizontal grouped bars (sequential MB/s,
// random IOPS), one group per server, medians of the run. Written by hand rather than
// with a plotting library so that the bench needs no dependency and the file diffs well.

const (
	chartWidth  = 960
	labelWidth  = 250 // server names, left of the bars
	valueRoom   = 70  // right of the longest bar, for its value
	barHeight   = 12
	barGap      = 2
	groupGap    = 10
	panelTop    = 58 // title, legend, axis labels above the first bar
	panelBottom = 26
)

type series struct {
	workload, label, color string
}

type panel struct {
	title  string
	series []series
}

func chartPanels(r *report) []panel {
	return []panel{
		{fmt.Sprintf("Sequential, MB/s (nbdcopy, %s)", sizeString(r.Size)), []series{
			{wlSeqWrite, "write", "#d95f02"}, {wlSeqRead, "read", "#1b9e77"},
		}},
		{"Random 4 KiB, IOPS (fio nbd engine, queue depth 32)", []series{
			{wlRandWrite, "write", "#d95f02"}, {wlRandRead, "read", "#1b9e77"},
		}},
	}
}

func renderChart(r *report) []byte {
	panels := chartPanels(r)
	groupH := func(p panel) int { return len(p.series)*(barHeight+barGap) - barGap + groupGap }
	height := 0
	for _, p := range panels {
		height += panelTop + len(r.Results)*groupH(p) + panelBottom
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		chartWidth, height, chartWidth, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", chartWidth, height)
	y0 := 0
	for _, p := range panels {
		y0 = renderPanel(&b, r, p, y0, groupH(p))
	}
	b.WriteString("</svg>\n")
	return b.Bytes()
}

// renderPanel draws one panel from y0 and returns where the next one starts.
func renderPanel(b *bytes.Buffer, r *report, p panel, y0, groupH int) int {
	maxV := 0.0
	for _, t := range r.Results {
		for _, s := range p.series {
			if v := t.median(s.workload); v > maxV {
				maxV = v
			}
		}
	}
	step := niceStep(maxV / 5)
	top := math.Max(step, math.Ceil(maxV/step)*step)
	x0, plotW := float64(labelWidth), float64(chartWidth-labelWidth-valueRoom)
	xOf := func(v float64) float64 { return x0 + plotW*v/top }
	barsTop := y0 + panelTop
	barsBottom := barsTop + len(r.Results)*groupH - groupGap

	fmt.Fprintf(b, `<text x="10" y="%d" font-size="15" font-weight="bold">%s</text>`+"\n", y0+22, esc(p.title))
	lx := labelWidth
	for _, s := range p.series {
		fmt.Fprintf(b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n",
			lx, y0+31, s.color, lx+16, y0+42, esc(s.label))
		lx += 80
	}
	for v := 0.0; v <= top+step/2; v += step {
		x := xOf(v)
		fmt.Fprintf(b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>`+"\n", x, barsTop-4, x, barsBottom+4)
		fmt.Fprintf(b, `<text x="%.1f" y="%d" text-anchor="middle" fill="#555">%s</text>`+"\n", x, barsBottom+18, esc(tick(v)))
	}
	y := barsTop
	for _, t := range r.Results {
		weight := "normal"
		if t.Name == nameEliAEAD {
			weight = "bold"
		}
		mid := y + (groupH-groupGap)/2 + 4
		fmt.Fprintf(b, `<text x="%d" y="%d" text-anchor="end" font-weight="%s">%s</text>`+"\n", labelWidth-8, mid, weight, esc(t.Label))
		for _, s := range p.series {
			v := t.median(s.workload)
			if math.IsNaN(v) {
				v = 0
			}
			fmt.Fprintf(b, `<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="%s"><title>%s %s: %s</title></rect>`+"\n",
				x0, y, xOf(v)-x0, barHeight, s.color, esc(t.Label), esc(s.label), number(v))
			fmt.Fprintf(b, `<text x="%.1f" y="%d" font-size="10" fill="#333">%s</text>`+"\n", xOf(v)+4, y+barHeight-2, number(v))
			y += barHeight + barGap
		}
		y += groupGap - barGap
	}
	return barsBottom + groupGap + panelBottom
}

// niceStep rounds x up to 1, 2 or 5 times a power of ten.
func niceStep(x float64) float64 {
	if !(x > 0) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(x)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= x {
			return m * p
		}
	}
	return 10 * p
}

func tick(v float64) string {
	switch {
	case v >= 1e6 && math.Mod(v, 1e6) == 0:
		return fmt.Sprintf("%gM", v/1e6)
	case v >= 1e3 && math.Mod(v, 1e3) == 0:
		return fmt.Sprintf("%gk", v/1e3)
	}
	return fmt.Sprintf("%g", v)
}

func esc(s string) string {
	var b strings.Builder
	xml.EscapeText(&b, []byte(s))
	return b.String()
}
