// Package keys reads and writes eli's on-disk volume header and manages its keys: the two
// header copies (start and end of the provider), the eight Argon2id keyslots that each wrap
// the 64-byte master key with XChaCha20-Poly1305, the HKDF-SHA256 key hierarchy derived
// from the master key, and mlocked, wipeable buffers for all key material.
//
// The byte layout is docs/format.md ("Header", "Keyslot", "Keys", "Backup file"); the
// golden header under testdata/ pins it.
//
// The API is deliberately small. Reading is Read (a provider) or Decode (a backup file);
// the result is a *Header, a decoded copy that says which header copy won and what was
// wrong with the other. Every operation that changes the header (Create, SetKey, DelKey,
// Kill, Restore, Resize) takes the provider, re-reads the header itself and writes both
// copies in the crash-safe order, so a caller never writes a stale or hand-edited header.
// Unlocking is (*Header).Unlock, which returns a *MasterKey; per-purpose keys come from
// its DataKey and JournalKey methods as *Secret values the caller must Wipe.
package keys
