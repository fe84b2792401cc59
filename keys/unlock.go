package keys

import (
	"fmt"
	"strings"
)

// AnySlot lets Unlock try every matching keyslot, and SetKey take the first free one.
const AnySlot = -1

// slot is keyslot i as the decoded bytes say, whatever the exported fields now hold.
func (h *Header) slot(i int) SlotInfo {
	info, err := decodeSlot(slotBytes(&h.raw, i))
	if err != nil {
		return SlotInfo{} // not a decoded header: treat as empty
	}
	return info
}

func (h *Header) rawVolumeID() (id [16]byte) {
	copy(id[:], h.raw[offVolumeID:])
	return id
}

// Unlock is UnlockWithin under DefaultKDFLimits.
func (h *Header) Unlock(c Credentials, slot int) (*MasterKey, int, error) {
	return h.UnlockWithin(c, slot, DefaultKDFLimits())
}

// UnlockWithin derives each candidate keyslot's key from c and unwraps the master key: every
// active slot whose credential kinds (passphrase, keyfiles, both) are exactly those in c,
// or only the given slot (0..NumSlots-1). It returns the master key and the slot that
// opened, after checking the header MAC with it.
//
// Errors: ErrNoCredentials; ErrNoKeys (no active slot); ErrSlotRange, ErrSlotEmpty (the
// given slot); ErrWrongKey (no candidate opens, or no slot takes these credential kinds);
// ErrHeaderTampered (a slot opened but the MAC-covered fields, such as the sector count,
// were changed); ErrKDFLimit (nothing opened, and a candidate was not tried).
//
// Candidates are tried in slot order within lim: a keyslot whose parameters exceed lim,
// or whose work exceeds what is left of lim.WorkKiB after the slots tried before it, is
// not derived at all. So a hostile header costs at most lim.WorkKiB in all, however many
// slots it fills.
func (h *Header) UnlockWithin(c Credentials, slot int, lim KDFLimits) (*MasterKey, int, error) {
	if err := c.check(); err != nil {
		return nil, -1, err
	}
	var infos [NumSlots]SlotInfo
	var active []string
	for i := range infos {
		infos[i] = h.slot(i)
		if infos[i].Active {
			active = append(active, fmt.Sprintf("%d takes %s", i, infos[i].Uses))
		}
	}
	if len(active) == 0 {
		return nil, -1, ErrNoKeys
	}
	uses := c.Uses()
	var try []int
	if slot != AnySlot {
		if slot < 0 || slot >= NumSlots {
			return nil, -1, newError(ErrSlotRange, "keyslot %d is out of range (0..%d)", slot, NumSlots-1)
		}
		if !infos[slot].Active {
			return nil, -1, newError(ErrSlotEmpty, "keyslot %d is empty", slot)
		}
		if infos[slot].Uses != uses {
			return nil, -1, newError(ErrWrongKey, "wrong passphrase or keyfile: keyslot %d takes %s, but %s was given", slot, infos[slot].Uses, uses)
		}
		try = []int{slot}
	} else {
		for i, info := range infos {
			if info.Active && info.Uses == uses {
				try = append(try, i)
			}
		}
		if len(try) == 0 {
			return nil, -1, newError(ErrWrongKey, "wrong passphrase or keyfile: no keyslot takes %s alone (keyslot %s)", uses, strings.Join(active, ", "))
		}
	}

	ikm := c.ikm()
	defer ikm.Wipe()
	budget := lim.WorkKiB
	var skipped []string
	for _, i := range try {
		p := infos[i].KDF
		if err := lim.Check(p); err != nil {
			skipped = append(skipped, fmt.Sprintf("keyslot %d: %v", i, err))
			continue
		}
		if p.work() > budget {
			skipped = append(skipped, fmt.Sprintf("keyslot %d: its Argon2id work %s × %d passes is more than is left (%s × passes) of the limit of %s × passes for one unlock",
				i, kib(uint64(p.MemoryKiB)), p.Time, kib(budget), kib(lim.WorkKiB)))
			continue
		}
		budget -= p.work()
		key := openSlot(&h.raw, i, infos[i], ikm)
		if key == nil {
			continue
		}
		mk := &MasterKey{volumeID: h.rawVolumeID(), key: key}
		if err := h.Verify(mk); err != nil {
			mk.Wipe()
			return nil, -1, err
		}
		return mk, i, nil
	}
	if len(skipped) > 0 {
		msg := "not derived, to bound the work a header can ask for"
		if len(skipped) < len(try) {
			msg = "the other keyslots did not open; " + msg
		}
		return nil, -1, newError(ErrKDFLimit, "%s (%s)", strings.Join(skipped, "; "), msg)
	}
	return nil, -1, ErrWrongKey
}
