package chacha

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"os"
	"strconv"
	"strings"
	"testing"
)

func unhex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	if err != nil {
		t.Fatalf("bad hex in test table: %v", err)
	}
	return b
}

// seq returns the bytes first, first+1, ..., as the RFC and draft keys are written.
func seq(first byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = first + byte(i)
	}
	return b
}

type vector struct {
	name      string
	rounds    int
	key       []byte
	nonce     []byte // 8, 12 or 24 bytes: picks New64, New or NewX
	counter   uint64
	plaintext []byte // nil: zeroes, so the ciphertext is the keystream
	want      []byte
}

// rfcVectors are from RFC 8439: §2.3.2 (block function), §2.4.2 (encryption), A.1
// (block function, test vectors #1-#5) and A.2 (encryption, #1-#3); and from
// draft-irtf-cfrg-xchacha-03 §A.3.2 (XChaCha20), whose keystream starts at block 1.
func rfcVectors(t testing.TB) []vector {
	zero32 := make([]byte, 32)
	zero12 := make([]byte, 12)
	key1 := append(make([]byte, 31), 1)
	nonce2 := append(make([]byte, 11), 2)
	return []vector{
		{"RFC8439 2.3.2", 20, seq(0, 32), unhex(t, "000000090000004a00000000"), 1, nil, unhex(t, `
			10f1e7e4d13b5915500fdd1fa32071c4 c7d1f4c733c068030422aa9ac3d46c4e
			d2826446079faa0914c2d705d98b02a2 b5129cd1de164eb9cbd083e8a2503c4e`)},
		{"RFC8439 2.4.2", 20, seq(0, 32), unhex(t, "000000000000004a00000000"), 1,
			[]byte("Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, sunscreen would be it."),
			unhex(t, `
			6e2e359a2568f98041ba0728dd0d6981 e97e7aec1d4360c20a27afccfd9fae0b
			f91b65c5524733ab8f593dabcd62b357 1639d624e65152ab8f530c359f0861d8
			07ca0dbf500d6a6156a38e088a22b65e 52bc514d16ccf806818ce91ab7793736
			5af90bbf74a35be6b40b8eedf2785e42 874d`)},
		{"RFC8439 A.1 #1", 20, zero32, zero12, 0, nil, unhex(t, `
			76b8e0ada0f13d90405d6ae55386bd28 bdd219b8a08ded1aa836efcc8b770dc7
			da41597c5157488d7724e03fb8d84a37 6a43b8f41518a11cc387b669b2ee6586`)},
		{"RFC8439 A.1 #2", 20, zero32, zero12, 1, nil, unhex(t, `
			9f07e7be5551387a98ba977c732d080d cb0f29a048e3656912c6533e32ee7aed
			29b721769ce64e43d57133b074d839d5 31ed1f28510afb45ace10a1f4b794d6f`)},
		{"RFC8439 A.1 #3", 20, key1, zero12, 1, nil, unhex(t, `
			3aeb5224ecf849929b9d828db1ced4dd 832025e8018b8160b82284f3c949aa5a
			8eca00bbb4a73bdad192b5c42f73f2fd 4e273644c8b36125a64addeb006c13a0`)},
		{"RFC8439 A.1 #4", 20, append([]byte{0, 0xff}, make([]byte, 30)...), zero12, 2, nil, unhex(t, `
			72d54dfbf12ec44b362692df94137f32 8fea8da73990265ec1bbbea1ae9af0ca
			13b25aa26cb4a648cb9b9d1be65b2c09 24a66c54d545ec1b7374f4872e99f096`)},
		{"RFC8439 A.1 #5", 20, zero32, nonce2, 0, nil, unhex(t, `
			c2c64d378cd536374ae204b9ef933fcd 1a8b2288b3dfa49672ab765b54ee27c7
			8a970e0e955c14f3a88e741b97c286f7 5f8fc299e8148362fa198a39531bed6d`)},
		{"RFC8439 A.2 #1", 20, zero32, zero12, 0, make([]byte, 64), unhex(t, `
			76b8e0ada0f13d90405d6ae55386bd28 bdd219b8a08ded1aa836efcc8b770dc7
			da41597c5157488d7724e03fb8d84a37 6a43b8f41518a11cc387b669b2ee6586`)},
		{"RFC8439 A.2 #2", 20, key1, nonce2, 1,
			[]byte("Any submission to the IETF intended by the Contributor for publication as all or part of an IETF " +
				"Internet-Draft or RFC and any statement made within the context of an IETF activity is considered " +
				"an \"IETF Contribution\". Such statements include oral statements in IETF sessions, as well as " +
				"written and electronic communications made at any time or place, which are addressed to"),
			unhex(t, `
			a3fbf07df3fa2fde4f376ca23e827370 41605d9f4f4f57bd8cff2c1d4b7955ec
			2a97948bd3722915c8f3d337f7d37005 0e9e96d647b7c39f56e031ca5eb6250d
			4042e02785ececfa4b4bb5e8ead0440e 20b6e8db09d881a7c6132f420e527950
			42bdfa7773d8a9051447b3291ce1411c 680465552aa6c405b7764d5e87bea85a
			d00f8449ed8f72d0d662ab052691ca66 424bc86d2df80ea41f43abf937d3259d
			c4b2d0dfb48a6c9139ddd7f76966e928 e635553ba76c5c879d7b35d49eb2e62b
			0871cdac638939e25e8a1e0ef9d5280f a8ca328b351c3c765989cbcf3daa8b6c
			cc3aaf9f3979c92b3720fc88dc95ed84 a1be059c6499b9fda236e7e818b04b0b
			c39c1e876b193bfe5569753f88128cc0 8aaa9b63d1a16f80ef2554d7189c411f
			5869ca52c5b83fa36ff216b9c1d30062 bebcfd2dc5bce0911934fda79a86f6e6
			98ced759c3ff9b6477338f3da4f9cd85 14ea9982ccafb341b2384dd902f3d1ab
			7ac61dd29c6f21ba5b862f3730e37cfd c4fd806c22f221`)},
		{"RFC8439 A.2 #3", 20, unhex(t, "1c9240a5eb55d38af333888604f6b5f0473917c1402b80099dca5cbc207075c0"), nonce2, 42,
			[]byte("'Twas brillig, and the slithy toves\nDid gyre and gimble in the wabe:\n" +
				"All mimsy were the borogoves,\nAnd the mome raths outgrabe."),
			unhex(t, `
			62e6347f95ed87a45ffae7426f27a1df 5fb69110044c0d73118effa95b01e5cf
			166d3df2d721caf9b21e5fb14c616871 fd84c54f9d65b283196c7fe4f60553eb
			f39c6402c42234e32a356b3e764312a6 1a5532055716ead6962568f87d3f3f77
			04c6a8d1bcd1bf4d50d6154b6da731b1 87b58dfd728afa36757a797ac188d1`)},
		{"xchacha-03 A.3.2", 20, seq(0x80, 32), unhex(t, "404142434445464748494a4b4c4d4e4f5051525354555658"), 1,
			[]byte("The dhole (pronounced \"dole\") is also known as the Asiatic wild dog, red dog, and whistling dog. " +
				"It is about the size of a German shepherd but looks more like a long-legged fox. This highly " +
				"elusive and skilled jumper is classified with wolves, coyotes, jackals, and foxes in the " +
				"taxonomic family Canidae."),
			unhex(t, `
			7d0a2e6b7f7c65a236542630294e063b7ab9b555a5d5149aa21e4ae1e4fbce87
			ecc8e08a8b5e350abe622b2ffa617b202cfad72032a3037e76ffdcdc4376ee05
			3a190d7e46ca1de04144850381b9cb29f051915386b8a710b8ac4d027b8b050f
			7cba5854e028d564e453b8a968824173fc16488b8970cac828f11ae53cabd201
			12f87107df24ee6183d2274fe4c8b1485534ef2c5fbc1ec24bfc3663efaa08bc
			047d29d25043532db8391a8a3d776bf4372a6955827ccb0cdd4af403a7ce4c63
			d595c75a43e045f0cce1f29c8b93bd65afc5974922f214a40b7c402cdb91ae73
			c0b63615cdad0480680f16515a7ace9d39236464328a37743ffc28f4ddb324f4
			d0f5bbdc270c65b1749a6efff1fbaa09536175ccd29fb9e6057b307320d31683
			8a9c71f70b5b5907a66f7ea49aadc409`)},
	}
}

// reducedRoundVectors reads testdata/chacha-reduced-rounds.txt (a copy of the project's
// shared vectors, draft-strombergson-chacha-test-vectors-01 §3.1-3.2; sources in the
// file). Each line becomes two cases: the original layout (8-byte IV, 64-bit counter)
// and, since the IVs are zero, the RFC 8439 layout with a zero 12-byte nonce.
func reducedRoundVectors(t testing.TB) []vector {
	f, err := os.Open("testdata/chacha-reduced-rounds.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var vs []vector
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fs := strings.Fields(line)
		if len(fs) != 6 {
			t.Fatalf("malformed vector line %q", line)
		}
		rounds, err1 := strconv.Atoi(fs[1])
		block, err2 := strconv.ParseUint(fs[4], 10, 64)
		if err1 != nil || err2 != nil {
			t.Fatalf("malformed vector line %q", line)
		}
		key, iv, ks := unhex(t, fs[2]), unhex(t, fs[3]), unhex(t, fs[5])
		name := fs[0] + " ChaCha" + fs[1] + " block " + fs[4]
		vs = append(vs, vector{name + " (64-bit counter)", rounds, key, iv, block, nil, ks})
		if bytes.Equal(iv, make([]byte, len(iv))) {
			vs = append(vs, vector{name + " (RFC 8439 layout)", rounds, key, make([]byte, 12), block, nil, ks})
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(vs) < 8 {
		t.Fatalf("only %d reduced-round vectors read", len(vs))
	}
	return vs
}

func newCipher(t testing.TB, rounds int, key, nonce []byte) *Cipher {
	t.Helper()
	var c *Cipher
	var err error
	switch len(nonce) {
	case NonceSize64:
		c, err = New64(rounds, key, nonce)
	case NonceSize:
		c, err = New(rounds, key, nonce)
	case NonceSizeX:
		c, err = NewX(rounds, key, nonce)
	default:
		t.Fatalf("no constructor for a %d-byte nonce", len(nonce))
	}
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestVectors runs every published vector through every engine, in one call, byte by
// byte, and (for the 32-bit counter layouts) through the one-shot functions.
func TestVectors(t *testing.T) {
	t.Parallel()
	vs := append(rfcVectors(t), reducedRoundVectors(t)...)
	for _, v := range vs {
		pt := v.plaintext
		if pt == nil {
			pt = make([]byte, len(v.want))
		}
		for _, e := range engines() {
			t.Run(v.name+"/"+e.String(), func(t *testing.T) {
				c := newCipher(t, v.rounds, v.key, v.nonce)
				c.eng = e
				c.SetCounter(v.counter)
				got := make([]byte, len(pt))
				c.XORKeyStream(got, pt)
				if !bytes.Equal(got, v.want) {
					t.Fatalf("one call:\n got %x\nwant %x", got, v.want)
				}
				c = newCipher(t, v.rounds, v.key, v.nonce)
				c.eng = e
				c.SetCounter(v.counter)
				for i := range pt {
					c.XORKeyStream(got[i:i+1], pt[i:i+1])
				}
				if !bytes.Equal(got, v.want) {
					t.Fatalf("byte by byte:\n got %x\nwant %x", got, v.want)
				}
				if len(v.nonce) == NonceSize64 {
					return
				}
				var st [16]uint32
				if len(v.nonce) == NonceSize {
					st = newCipher(t, v.rounds, v.key, v.nonce).st
				} else {
					xState(&st, v.rounds, (*[KeySize]byte)(v.key), (*[NonceSizeX]byte)(v.nonce))
				}
				st[12] = uint32(v.counter)
				clear(got)
				xorAt(e, &st, v.rounds, got, pt)
				if !bytes.Equal(got, v.want) {
					t.Fatalf("one-shot:\n got %x\nwant %x", got, v.want)
				}
			})
		}
	}
}

// TestOneShotVectors checks the exported one-shot entry points against the same vectors.
func TestOneShotVectors(t *testing.T) {
	t.Parallel()
	for _, v := range rfcVectors(t) {
		pt := v.plaintext
		if pt == nil {
			pt = make([]byte, len(v.want))
		}
		got := make([]byte, len(pt))
		switch len(v.nonce) {
		case NonceSize:
			XORKeyStreamAt(v.rounds, (*[KeySize]byte)(v.key), (*[NonceSize]byte)(v.nonce), uint32(v.counter), got, pt)
		case NonceSizeX:
			XORKeyStreamXAt(v.rounds, (*[KeySize]byte)(v.key), (*[NonceSizeX]byte)(v.nonce), uint32(v.counter), got, pt)
		}
		if !bytes.Equal(got, v.want) {
			t.Errorf("%s:\n got %x\nwant %x", v.name, got, v.want)
		}
	}
}

// TestHChaCha20Vector is draft-irtf-cfrg-xchacha-03 §2.2.1.
func TestHChaCha20Vector(t *testing.T) {
	t.Parallel()
	got, err := HChaCha(20, seq(0, 32), unhex(t, "000000090000004a0000000031415927"))
	if err != nil {
		t.Fatal(err)
	}
	want := unhex(t, "82413b4227b27bfed30e42508a877d73a0f9e4d58a74a853c12ec41326d3ecdc")
	if !bytes.Equal(got[:], want) {
		t.Fatalf("got %x, want %x", got, want)
	}
}
