package keys

import (
	"crypto/rand"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/crypto/argon2"
	"golang.org/x/sys/unix"
)

// KDFParams are one keyslot's Argon2id (version 0x13) parameters.
type KDFParams struct {
	Time      uint32 // passes over memory, 1..1000
	MemoryKiB uint32 // 8·Threads KiB .. 4 GiB
	Threads   uint8  // lanes, 1..255
}

// Bounds on what a header may ask for, so that a hostile header cannot exhaust the
// machine that opens it.
const (
	MaxKDFTime      = 1000
	MaxKDFMemoryKiB = 4 << 20 // 4 GiB
)

// KDFLimits bound the Argon2id work that keyslot parameters read from a header may make
// this machine do. The format allows up to 4 GiB × 1000 passes × 255 lanes per keyslot,
// and Unlock may try all eight keyslots: a provider someone hands over could otherwise
// keep an unlock busy for days, or exhaust the machine's memory.
type KDFLimits struct {
	MemoryKiB uint64 // most memory one derivation may use
	Threads   int    // most lanes one derivation may use
	// WorkKiB is the most memory × passes (in KiB) that one Unlock may spend on all the
	// keyslots it tries together, and that one keyslot may ask for.
	WorkKiB uint64
}

// Default limits: see DefaultKDFLimits.
const (
	LimitKDFThreads = 16
	LimitKDFWorkKiB = 32 << 20 // 32 GiB × passes: 64 passes at 512 MiB
)

// NoKDFLimits lets parameters go up to what the format allows (what
// --kdf-allow-expensive asks for).
var NoKDFLimits = KDFLimits{MemoryKiB: math.MaxUint64, Threads: math.MaxInt, WorkKiB: math.MaxUint64}

// DefaultKDFLimits are the limits Unlock applies: memory at most half of this machine's
// memory (or cgroup limit) and at most MaxKDFMemoryKiB, at most LimitKDFThreads lanes,
// and LimitKDFWorkKiB of memory × passes in all.
func DefaultKDFLimits() KDFLimits { return defaultLimits(availableMemory()) }

func defaultLimits(total uint64) KDFLimits {
	mem := uint64(MaxKDFMemoryKiB)
	if total > 0 {
		mem = min(mem, total/2>>10)
	}
	return KDFLimits{MemoryKiB: mem, Threads: LimitKDFThreads, WorkKiB: LimitKDFWorkKiB}
}

// work is the memory × passes one derivation with p costs, in KiB.
func (p KDFParams) work() uint64 { return uint64(p.MemoryKiB) * uint64(p.Time) }

// Check reports whether one derivation with p stays within l; the error wraps ErrKDFLimit
// and names the limit.
func (l KDFLimits) Check(p KDFParams) error {
	switch {
	case uint64(p.MemoryKiB) > l.MemoryKiB:
		return newError(ErrKDFLimit, "Argon2id memory %s is more than the limit of %s (half of this machine's memory, at most %s)",
			kib(uint64(p.MemoryKiB)), kib(l.MemoryKiB), kib(MaxKDFMemoryKiB))
	case int(p.Threads) > l.Threads:
		return newError(ErrKDFLimit, "Argon2id with %d lanes is more than the limit of %d lanes", p.Threads, l.Threads)
	case p.work() > l.WorkKiB:
		return newError(ErrKDFLimit, "Argon2id work %s × %d passes is more than the limit of %s × passes",
			kib(uint64(p.MemoryKiB)), p.Time, kib(l.WorkKiB))
	}
	return nil
}

// kib formats a size in KiB for messages.
func kib(n uint64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d GiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d MiB", n>>10)
	}
	return fmt.Sprintf("%d KiB", n)
}

// Default calibration inputs (see Calibrate).
const (
	DefaultKDFTarget = time.Second
	defaultMemoryMiB = 512 // inside the [256 MiB, 1 GiB] band the issue asks for
	minScaledMiB     = 256 // Calibrate trades memory for time down to this, no further
)

const kekSize = 32

// Validate reports whether p is within the bounds eli accepts; the error wraps
// ErrKDFParams.
func (p KDFParams) Validate() error {
	switch {
	case p.Time < 1 || p.Time > MaxKDFTime:
		return newError(ErrKDFParams, "KDF parameters out of range: %d passes (want 1..%d)", p.Time, MaxKDFTime)
	case p.Threads < 1:
		return newError(ErrKDFParams, "KDF parameters out of range: 0 threads (want 1..255)")
	case p.MemoryKiB < 8*uint32(p.Threads) || p.MemoryKiB > MaxKDFMemoryKiB:
		// RFC 9106 section 3.1: memory is at least 8·p KiB.
		return newError(ErrKDFParams, "KDF parameters out of range: memory %d KiB (want %d..%d KiB for %d threads)",
			p.MemoryKiB, 8*uint32(p.Threads), MaxKDFMemoryKiB, p.Threads)
	}
	return nil
}

func (p KDFParams) String() string {
	return fmt.Sprintf("argon2id t=%d m=%d KiB p=%d", p.Time, p.MemoryKiB, p.Threads)
}

// kek derives a keyslot's key-encryption key from the credentials' ikm.
func (p KDFParams) kek(ikm *Secret, salt []byte) *Secret {
	k := argon2.IDKey(ikm.Bytes(), salt, p.Time, p.MemoryKiB, p.Threads, kekSize)
	s := secretFrom(k)
	clear(k)
	return s
}

// Calibrate returns Argon2id parameters whose derivation takes about target on this
// machine, by timing one pass at the chosen memory and threads. Zero arguments take the
// defaults: target DefaultKDFTarget; memory 512 MiB, but at most a quarter of the memory
// this machine or cgroup has (never below 8 MiB); threads min(4, NumCPU). When one pass
// at the default memory takes well over the target (a slow machine), the memory is scaled
// down towards the target, but not below 256 MiB. An explicit memoryMiB is used as given
// (within the bounds of KDFParams.Validate). Calibrating costs one or two derivations.
func Calibrate(target time.Duration, memoryMiB, threads int) (KDFParams, error) {
	return calibrate(target, memoryMiB, threads, availableMemory(), onePass)
}

func calibrate(target time.Duration, memoryMiB, threads int, avail uint64, measure func(KDFParams) (time.Duration, error)) (KDFParams, error) {
	if target <= 0 {
		target = DefaultKDFTarget
	}
	if threads <= 0 {
		threads = min(4, runtime.NumCPU())
	}
	scalable := memoryMiB <= 0
	if scalable {
		memoryMiB = defaultMemory(avail)
	}
	if threads > 255 || memoryMiB > MaxKDFMemoryKiB/1024 {
		return KDFParams{}, newError(ErrKDFParams, "KDF parameters out of range: %d MiB, %d threads", memoryMiB, threads)
	}
	p := KDFParams{Time: 1, MemoryKiB: uint32(memoryMiB) * 1024, Threads: uint8(threads)}
	if err := p.Validate(); err != nil {
		return KDFParams{}, err
	}
	one, err := measure(p)
	if err != nil {
		return KDFParams{}, err
	}
	if floor := min(memoryMiB, minScaledMiB); scalable && one > target*3/2 && memoryMiB > floor {
		// Argon2's time is about linear in memory.
		mib := max(int(int64(memoryMiB)*int64(target)/int64(one)), floor)
		p.MemoryKiB = uint32(mib) * 1024
		if one, err = measure(p); err != nil {
			return KDFParams{}, err
		}
	}
	passes := (target + one/2) / one
	p.Time = uint32(min(max(passes, 1), MaxKDFTime))
	return p, nil
}

// onePass times one Argon2id pass with p's memory and threads. It includes allocating and
// touching the memory, which a real derivation pays too (each runs in a fresh allocation),
// so target/one-pass slightly undershoots rather than overshoots the target.
func onePass(p KDFParams) (time.Duration, error) {
	salt := make([]byte, 32)
	if _, err := rand.Read(salt); err != nil {
		return 0, fmt.Errorf("calibrate KDF: %w", err)
	}
	start := time.Now()
	argon2.IDKey([]byte("eli calibration"), salt, 1, p.MemoryKiB, p.Threads, kekSize)
	return max(time.Since(start), time.Microsecond), nil
}

// defaultMemory picks the default Argon2 memory in MiB for a machine where avail bytes
// are available (0: unknown).
func defaultMemory(avail uint64) int {
	m := defaultMemoryMiB
	if avail > 0 {
		m = min(m, int(avail/4>>20))
	}
	return max(m, 8)
}

// availableMemory is the physical memory, or the cgroup (v2) limit when that is lower; 0
// if neither is known.
func availableMemory() uint64 {
	var total uint64
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		total = uint64(si.Totalram) * uint64(si.Unit)
	}
	if b, err := os.ReadFile("/sys/fs/cgroup/memory.max"); err == nil {
		if lim, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); err == nil && (total == 0 || lim < total) {
			total = lim
		}
	}
	return total
}

// Fixed returns parameters with the given passes and no calibration; zero memoryMiB and
// threads take Calibrate's defaults (512 MiB within the machine's means, min(4, NumCPU)).
// It is what `--kdf-time N` asks for.
func Fixed(passes, memoryMiB, threads int) (KDFParams, error) {
	if threads <= 0 {
		threads = min(4, runtime.NumCPU())
	}
	if memoryMiB <= 0 {
		memoryMiB = defaultMemory(availableMemory())
	}
	if passes < 1 || passes > MaxKDFTime || threads > 255 || memoryMiB > MaxKDFMemoryKiB/1024 {
		return KDFParams{}, newError(ErrKDFParams, "KDF parameters out of range: %d passes, %d MiB, %d threads", passes, memoryMiB, threads)
	}
	p := KDFParams{Time: uint32(passes), MemoryKiB: uint32(memoryMiB) * 1024, Threads: uint8(threads)}
	return p, p.Validate()
}
