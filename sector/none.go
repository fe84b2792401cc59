package sector

// noneCodec stores plaintext: it exists to measure what the rest of eli costs.
type noneCodec struct{ size int }

func newNone(p Params) Codec { return noneCodec{p.SectorSize} }

func (noneCodec) Mode() Mode                        { return ModeNone }
func (c noneCodec) SectorSize() int                 { return c.size }
func (noneCodec) MetaSize() int                     { return 0 }
func (noneCodec) Seal(uint64, []byte, []byte)       {}
func (noneCodec) Open(uint64, []byte, []byte) error { return nil }
func (noneCodec) Wipe()                             {}
