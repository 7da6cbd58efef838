package metadata

import (
	"bufio"
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// model is a thin pool as thin_dump's XML describes it: what the tests
// write for thin_restore and what they expect to read back.
type model struct {
	Time          uint32
	TransactionID uint64
	DataBlockSize uint32
	NrDataBlocks  uint64
	Devices       []modelDevice // ascending ids
}

type modelDevice struct {
	Device
	Mappings []Mapping // ascending virtual blocks
}

// refCounts is how many mappings point at each data block.
func (m *model) refCounts() map[uint64]uint32 {
	rc := map[uint64]uint32{}
	for _, d := range m.Devices {
		for _, mp := range d.Mappings {
			rc[mp.DBlock]++
		}
	}
	return rc
}

// writeXML writes m in thin_dump's format, folding runs of consecutive
// blocks written at one time into range_mappings as thin_dump does.
func (m *model) writeXML(w io.Writer) error {
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, `<superblock uuid="" time="%d" transaction="%d" flags="0" version="2" data_block_size="%d" nr_data_blocks="%d">`+"\n",
		m.Time, m.TransactionID, m.DataBlockSize, m.NrDataBlocks)
	for _, d := range m.Devices {
		fmt.Fprintf(bw, `  <device dev_id="%d" mapped_blocks="%d" transaction="%d" creation_time="%d" snap_time="%d">`+"\n",
			d.ID, d.MappedBlocks, d.TransactionID, d.CreationTime, d.SnapshottedTime)
		ms := d.Mappings
		for i := 0; i < len(ms); {
			j := i + 1
			for j < len(ms) && ms[j].VBlock == ms[j-1].VBlock+1 && ms[j].DBlock == ms[j-1].DBlock+1 && ms[j].Time == ms[i].Time {
				j++
			}
			if j-i == 1 {
				fmt.Fprintf(bw, `    <single_mapping origin_block="%d" data_block="%d" time="%d"/>`+"\n", ms[i].VBlock, ms[i].DBlock, ms[i].Time)
			} else {
				fmt.Fprintf(bw, `    <range_mapping origin_begin="%d" data_begin="%d" length="%d" time="%d"/>`+"\n", ms[i].VBlock, ms[i].DBlock, j-i, ms[i].Time)
			}
			i = j
		}
		fmt.Fprintf(bw, "  </device>\n")
	}
	fmt.Fprintf(bw, "</superblock>\n")
	return bw.Flush()
}

// The elements of thin_dump's XML.
type xmlSuperblock struct {
	Time          uint32      `xml:"time,attr"`
	Transaction   uint64      `xml:"transaction,attr"`
	Flags         uint32      `xml:"flags,attr"`
	Version       uint32      `xml:"version,attr"`
	DataBlockSize uint32      `xml:"data_block_size,attr"`
	NrDataBlocks  uint64      `xml:"nr_data_blocks,attr"`
	Devices       []xmlDevice `xml:"device"`
}

type xmlDevice struct {
	ID           uint64      `xml:"dev_id,attr"`
	MappedBlocks uint64      `xml:"mapped_blocks,attr"`
	Transaction  uint64      `xml:"transaction,attr"`
	CreationTime uint32      `xml:"creation_time,attr"`
	SnapTime     uint32      `xml:"snap_time,attr"`
	Ranges       []xmlRange  `xml:"range_mapping"`
	Singles      []xmlSingle `xml:"single_mapping"`
	Unknown      []xml.Name  `xml:",any"`
}

type xmlRange struct {
	OriginBegin uint64 `xml:"origin_begin,attr"`
	DataBegin   uint64 `xml:"data_begin,attr"`
	Length      uint64 `xml:"length,attr"`
	Time        uint32 `xml:"time,attr"`
}

type xmlSingle struct {
	OriginBlock uint64 `xml:"origin_block,attr"`
	DataBlock   uint64 `xml:"data_block,attr"`
	Time        uint32 `xml:"time,attr"`
}

// parseXML reads thin_dump's XML into a model.
func parseXML(r io.Reader) (*model, error) {
	var sb xmlSuperblock
	if err := xml.NewDecoder(r).Decode(&sb); err != nil {
		return nil, err
	}
	m := &model{Time: sb.Time, TransactionID: sb.Transaction, DataBlockSize: sb.DataBlockSize, NrDataBlocks: sb.NrDataBlocks}
	for _, d := range sb.Devices {
		if len(d.Unknown) > 0 {
			return nil, fmt.Errorf("device %d: unexpected element %s", d.ID, d.Unknown[0].Local)
		}
		md := modelDevice{Device: Device{ID: d.ID, MappedBlocks: d.MappedBlocks, TransactionID: d.Transaction, CreationTime: d.CreationTime, SnapshottedTime: d.SnapTime}}
		for _, r := range d.Ranges {
			for i := uint64(0); i < r.Length; i++ {
				md.Mappings = append(md.Mappings, Mapping{VBlock: r.OriginBegin + i, DBlock: r.DataBegin + i, Time: r.Time})
			}
		}
		for _, s := range d.Singles {
			md.Mappings = append(md.Mappings, Mapping{VBlock: s.OriginBlock, DBlock: s.DataBlock, Time: s.Time})
		}
		slices.SortFunc(md.Mappings, func(a, b Mapping) int { return cmpUint64(a.VBlock, b.VBlock) })
		m.Devices = append(m.Devices, md)
	}
	slices.SortFunc(m.Devices, func(a, b modelDevice) int { return cmpUint64(a.ID, b.ID) })
	return m, nil
}

func cmpUint64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// readModel reads everything a Pool says about devices and mappings.
func readModel(p *Pool) (*model, error) {
	sb := p.Superblock()
	m := &model{Time: sb.Time, TransactionID: sb.TransactionID, DataBlockSize: sb.DataBlockSize, NrDataBlocks: sb.DataSpaceMap.NrBlocks}
	err := p.WalkDevices(func(d Device) error {
		m.Devices = append(m.Devices, modelDevice{Device: d})
		return nil
	})
	if err != nil {
		return nil, err
	}
	for i := range m.Devices {
		d := &m.Devices[i]
		err := p.WalkMappings(d.ID, 0, func(mp Mapping) error {
			d.Mappings = append(d.Mappings, mp)
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	return m, nil
}

// diffModels describes the first few differences between two models.
func diffModels(want, got *model) string {
	var b strings.Builder
	if want.Time != got.Time || want.TransactionID != got.TransactionID || want.DataBlockSize != got.DataBlockSize || want.NrDataBlocks != got.NrDataBlocks {
		fmt.Fprintf(&b, "pool: got time %d trans %d block size %d data blocks %d, want %d %d %d %d\n",
			got.Time, got.TransactionID, got.DataBlockSize, got.NrDataBlocks, want.Time, want.TransactionID, want.DataBlockSize, want.NrDataBlocks)
	}
	if len(want.Devices) != len(got.Devices) {
		fmt.Fprintf(&b, "got %d devices, want %d\n", len(got.Devices), len(want.Devices))
		return b.String()
	}
	for i, w := range want.Devices {
		g := got.Devices[i]
		if w.Device != g.Device {
			fmt.Fprintf(&b, "device: got %+v, want %+v\n", g.Device, w.Device)
		}
		if len(w.Mappings) != len(g.Mappings) {
			fmt.Fprintf(&b, "device %d: got %d mappings, want %d\n", w.ID, len(g.Mappings), len(w.Mappings))
		}
		for j := 0; j < min(len(w.Mappings), len(g.Mappings)); j++ {
			if w.Mappings[j] != g.Mappings[j] {
				fmt.Fprintf(&b, "device %d mapping %d: got %+v, want %+v\n", w.ID, j, g.Mappings[j], w.Mappings[j])
				break
			}
		}
	}
	return b.String()
}

// tool returns the path of a thin-provisioning-tools program. Outside CI
// a machine without the package skips; in CI (which installs it through
// scripts/test.sh) its absence is a failure.
func tool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s not installed (Debian package thin-provisioning-tools)", name)
		}
		t.Skipf("%s not installed (Debian package thin-provisioning-tools)", name)
	}
	return p
}

// restore writes m as XML and runs thin_restore on it into a new
// metadata file of size bytes, returning the file's path.
func restore(t testing.TB, m *model, size int64) string {
	t.Helper()
	dir := t.TempDir()
	xmlPath := filepath.Join(dir, "pool.xml")
	f, err := os.Create(xmlPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.writeXML(f); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return restoreFile(t, xmlPath, size)
}

// restoreFile runs thin_restore on an XML file.
func restoreFile(t testing.TB, xmlPath string, size int64) string {
	t.Helper()
	meta := filepath.Join(t.TempDir(), "meta.img")
	if err := os.WriteFile(meta, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(meta, size); err != nil {
		t.Fatal(err)
	}
	run(t, tool(t, "thin_restore"), "-i", xmlPath, "-o", meta)
	return meta
}

// run runs a program and returns its standard output.
func run(t testing.TB, prog string, args ...string) []byte {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(prog, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(prog), strings.Join(args, " "), err, stderr.String())
	}
	return stdout.Bytes()
}

// openFile opens a metadata file with Open.
func openFile(t testing.TB, path string) *Pool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	p, err := Open(f, st.Size())
	if err != nil {
		t.Fatalf("Open %s: %v", path, err)
	}
	return p
}
