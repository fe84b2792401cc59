package poly1305

import (
	"bytes"
	"encoding/binary"
	"math/big"
	"math/rand"
	"sync"
	"testing"

	"golang.org/x/crypto/poly1305"
)

// macInput builds RFC 8439 §2.8's MAC input explicitly.
func macInput(ad, ct []byte) []byte {
	m := make([]byte, 0, len(ad)+len(ct)+48)
	m = append(m, ad...)
	m = append(m, make([]byte, padLen(len(ad)))...)
	m = append(m, ct...)
	m = append(m, make([]byte, padLen(len(ct)))...)
	m = binary.LittleEndian.AppendUint64(m, uint64(len(ad)))
	return binary.LittleEndian.AppendUint64(m, uint64(len(ct)))
}

// checkAll compares every path's SumAEAD with x/crypto's Sum of the explicit input.
func checkAll(t *testing.T, what string, key *[32]byte, ad, ct []byte) {
	t.Helper()
	var want [16]byte
	poly1305.Sum(&want, macInput(ad, ct), key)
	for _, p := range paths() {
		var tag [16]byte
		sumAEAD(p, &tag, key, ad, ct)
		if tag != want {
			t.Fatalf("%v, %s, len(ad) %d, len(ct) %d: tag %x, x/crypto %x",
				p, what, len(ad), len(ct), tag, want)
		}
	}
}

// ctLengths: every length up to 600, then a stride to 4200 that also hits the lengths
// around multiples of 128 (the kernel's chunk) and 4096.
func ctLengths() []int {
	var ns []int
	for n := 0; n <= 600; n++ {
		ns = append(ns, n)
	}
	for n := 601; n <= 4200; n += 53 {
		ns = append(ns, n)
	}
	for _, base := range []int{1024, 2048, 4096} {
		for d := -17; d <= 17; d++ {
			ns = append(ns, base+d)
		}
	}
	return ns
}

// TestSumAEADMatchesXCrypto: random keys and data, ad of 0..70 bytes against a range
// of ciphertext lengths, and ct lengths against a few ad lengths.
func TestSumAEADMatchesXCrypto(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewSource(1))
	buf := make([]byte, 8192)
	rng.Read(buf)
	var key [32]byte
	for adLen := 0; adLen <= 70; adLen++ {
		for _, ctLen := range []int{0, 1, 15, 16, 17, 127, 128, 255, 256, 257, 512, 1000, 4096} {
			rng.Read(key[:])
			checkAll(t, "random", &key, buf[:adLen], buf[adLen:adLen+ctLen])
		}
	}
	for _, ctLen := range ctLengths() {
		for _, adLen := range []int{0, 13, 42, 64} {
			rng.Read(key[:])
			off := rng.Intn(64) // unaligned starts
			checkAll(t, "random", &key, buf[off:off+adLen], buf[off+adLen:off+adLen+ctLen])
		}
	}
	// Long additional data takes the kernel too, and so does ct after it with a
	// nonzero accumulator.
	for _, adLen := range []int{255, 256, 300, 1024, 3000} {
		rng.Read(key[:])
		checkAll(t, "long ad", &key, buf[:adLen], buf[adLen:adLen+700])
	}
}

// TestSumAEADSpecialKeys: keys and data at the edges of the arithmetic: all-ones
// blocks, r with every bit the clamp allows, s that carries into every byte, and long
// runs of them (the kernel's limb bounds).
func TestSumAEADSpecialKeys(t *testing.T) {
	t.Parallel()
	ones := bytes.Repeat([]byte{0xff}, 70000)
	zeros := make([]byte, 70000)
	rng := rand.New(rand.NewSource(2))
	random := make([]byte, 70000)
	rng.Read(random)
	keys := map[string][32]byte{}
	var k [32]byte
	for i := range k {
		k[i] = 0xff // r clamps to every allowed bit; s = 2^128−1
	}
	keys["all ones"] = k
	k = [32]byte{}
	keys["zero"] = k
	k[0] = 1
	keys["r=1"] = k
	for i := 16; i < 32; i++ {
		k[i] = 0xff
	}
	keys["r=1, s=2^128-1"] = k
	rng.Read(k[:16])
	keys["random r, s=2^128-1"] = k
	k = [32]byte{}
	for i := 0; i < 16; i++ {
		k[i] = 0xff
	}
	rng.Read(k[16:])
	keys["max r, random s"] = k
	for name, key := range keys {
		for _, data := range []struct {
			name string
			b    []byte
		}{{"ones", ones}, {"zeros", zeros}, {"random", random}} {
			for _, n := range []int{0, 16, 112, 128, 256, 512, 4096, 4096 + 15, 65536, 70000 - 42} {
				checkAll(t, name+"/"+data.name, &key, data.b[:42], data.b[42:42+n])
				checkAll(t, name+"/"+data.name+", no ad", &key, nil, data.b[:n])
			}
		}
	}
}

// TestSumAEADNearModulus steers the accumulator to values just below and just above
// 2^130−5 before the final reduction and checks the tag against the value worked out
// here. r = 1 makes h the plain sum of the blocks (each with its 2^128 bit) mod 2^130−5,
// and with s = 0 the tag is (h mod 2^130−5) mod 2^128.
func TestSumAEADNearModulus(t *testing.T) {
	t.Parallel()
	var key [32]byte
	key[0] = 1
	for _, ctBlocks := range []int{2, 4, 16, 40, 256} {
		for d := -6; d <= 6; d++ {
			ct := nearModulus(ctBlocks, d)
			var want [16]byte
			if d >= 0 {
				want[0] = byte(d)
			} else { // 2^130−5+d ≡ −5+d (mod 2^128)
				binary.LittleEndian.PutUint64(want[0:8], uint64(-5+d))
				binary.LittleEndian.PutUint64(want[8:16], ^uint64(0))
			}
			for _, p := range paths() {
				var tag [16]byte
				sumAEAD(p, &tag, &key, nil, ct)
				if tag != want {
					t.Errorf("%v, %d blocks, h ≡ p%+d: tag %x, want %x", p, ctBlocks, d, tag, want)
				}
			}
			checkAll(t, "near the modulus", &key, nil, ct)
		}
	}
}

// nearModulus returns n ciphertext blocks whose MAC input (no ad, r = 1) sums to
// 2^130−5+d mod 2^130−5. With n = 2 the sum is exactly that integer: nothing has been
// reduced before the end. Otherwise the blocks are all ones but the last four, which
// take up the difference.
func nearModulus(n, d int) []byte {
	p := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 130), big.NewInt(5))
	two128 := new(big.Int).Lsh(big.NewInt(1), 128)
	block := func(b []byte) *big.Int { // little-endian block plus its 2^128 bit
		r := make([]byte, 16)
		for i := range r {
			r[i] = b[15-i]
		}
		return new(big.Int).Add(new(big.Int).SetBytes(r), two128)
	}
	put := func(b []byte, v *big.Int) {
		be := v.FillBytes(make([]byte, 16))
		for i := range be {
			b[i] = be[15-i]
		}
	}
	ct := make([]byte, 16*n)
	free := 4
	if n == 2 {
		free = 2
	}
	for i := 0; i < len(ct)-16*free; i++ {
		ct[i] = 0xff
	}
	var lens [16]byte
	binary.LittleEndian.PutUint64(lens[8:], uint64(len(ct)))
	sum := block(lens[:])
	for i := 0; i < n; i++ {
		sum.Add(sum, block(ct[16*i:])) // the free blocks count as their 2^128 bit
	}
	target := new(big.Int).Add(p, big.NewInt(int64(d)))
	x := new(big.Int).Sub(target, sum)
	if n != 2 {
		x.Mod(x, p)
	}
	limit := new(big.Int).Sub(two128, big.NewInt(1))
	for i := n - free; i < n; i++ { // greedy: < 4·(2^128−1) always fits
		v := x
		if x.Cmp(limit) > 0 {
			v = limit
		}
		if v.Sign() < 0 {
			panic("nearModulus: negative block")
		}
		put(ct[16*i:], v)
		x = new(big.Int).Sub(x, v)
	}
	if x.Sign() != 0 {
		panic("nearModulus: the difference does not fit the free blocks")
	}
	return ct
}

// TestSumAEADNoAllocs: SumAEAD allocates nothing, on any path.
func TestSumAEADNoAllocs(t *testing.T) {
	var key [32]byte
	var tag [16]byte
	ad := make([]byte, 42)
	ct := make([]byte, 4096+7)
	for _, p := range paths() {
		if n := testing.AllocsPerRun(20, func() { sumAEAD(p, &tag, &key, ad, ct) }); n != 0 {
			t.Errorf("%v: %v allocations per call", p, n)
		}
	}
	if n := testing.AllocsPerRun(20, func() { SumAEAD(&tag, &key, ad, ct) }); n != 0 {
		t.Errorf("SumAEAD: %v allocations per call", n)
	}
}

// TestSumAEADConcurrent: calls from many goroutines give the tags one goroutine gets.
func TestSumAEADConcurrent(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewSource(3))
	type job struct {
		key    [32]byte
		ad, ct []byte
		want   [16]byte
	}
	jobs := make([]job, 16)
	for i := range jobs {
		j := &jobs[i]
		rng.Read(j.key[:])
		j.ad = make([]byte, 42)
		j.ct = make([]byte, 512*(i+1))
		rng.Read(j.ad)
		rng.Read(j.ct)
		poly1305.Sum(&j.want, macInput(j.ad, j.ct), &j.key)
	}
	var wg sync.WaitGroup
	errs := make(chan string, len(jobs))
	for i := range jobs {
		wg.Add(1)
		go func(j *job) {
			defer wg.Done()
			for k := 0; k < 50; k++ {
				var tag [16]byte
				SumAEAD(&tag, &j.key, j.ad, j.ct)
				if tag != j.want {
					errs <- "wrong tag under concurrency"
					return
				}
			}
		}(&jobs[i])
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
}

// TestAccelerated: Accelerated reports the path SumAEAD takes.
func TestAccelerated(t *testing.T) {
	ps := paths()
	if got, want := Accelerated(), ps[len(ps)-1] == pathIFMA; got != want || defaultPath != ps[len(ps)-1] {
		t.Errorf("Accelerated() = %v with paths %v and default %v", got, ps, defaultPath)
	}
}
