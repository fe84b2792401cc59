package testtool

// NBDInfo is the document `nbdinfo --json` prints (libnbd's nbdinfo(1), the fields eli's
// tests look at), for tests that check what a server advertises.
type NBDInfo struct {
	Protocol   string          `json:"protocol"`
	TLS        bool            `json:"TLS"`
	Structured bool            `json:"structured"`
	Exports    []NBDInfoExport `json:"exports"`
}

// NBDInfoExport is one export in NBDInfo.
type NBDInfoExport struct {
	Name         string `json:"export-name"`
	Description  string `json:"description"`
	Size         int64  `json:"export-size"`
	ReadOnly     bool   `json:"is_read_only"`
	CanFlush     bool   `json:"can_flush"`
	CanFUA       bool   `json:"can_fua"`
	CanTrim      bool   `json:"can_trim"`
	CanZero      bool   `json:"can_zero"`
	CanFastZero  bool   `json:"can_fast_zero"`
	CanMultiConn bool   `json:"can_multi_conn"`
	CanCache     bool   `json:"can_cache"`
	CanDF        bool   `json:"can_df"`
	MinBlock     int64  `json:"block_size_minimum"`
	PrefBlock    int64  `json:"block_size_preferred"`
	MaxBlock     int64  `json:"block_size_maximum"`
}
