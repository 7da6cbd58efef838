package metadata

import "fmt"

// Device is one thin device's entry in the device-details btree.
type Device struct {
	ID              uint64
	MappedBlocks    uint64
	TransactionID   uint64 // the pool's transaction id when it was created
	CreationTime    uint32 // the pool's time when it was created
	SnapshottedTime uint32 // the pool's time when it was last snapshotted
}

func decodeDevice(id uint64, v []byte) Device {
	return Device{
		ID:              id,
		MappedBlocks:    le64(v, ddMappedBlocks),
		TransactionID:   le64(v, ddTransactionID),
		CreationTime:    le32(v, ddCreationTime),
		SnapshottedTime: le32(v, ddSnapshottedTime),
	}
}

// Mapping maps one virtual block of a thin device to a data block. Time
// is the pool's snapshot epoch when the block was written: a block
// written before the device's last snapshot is shared with it.
type Mapping struct {
	VBlock uint64
	DBlock uint64
	Time   uint32
}

func (p *Pool) decodeMapping(dev, vblock uint64, v []byte) (Mapping, error) {
	x := le64(v, 0)
	m := Mapping{VBlock: vblock, DBlock: x >> mappingTimeBits, Time: uint32(x & (1<<mappingTimeBits - 1))}
	if m.DBlock >= p.sb.DataSpaceMap.NrBlocks {
		return Mapping{}, fmt.Errorf("%w: thin device %d block %d maps to data block %d of %d", ErrCorrupt, dev, vblock, m.DBlock, p.sb.DataSpaceMap.NrBlocks)
	}
	return m, nil
}

// WalkDevices calls fn with every thin device, in ascending id order,
// until fn returns an error, which it returns.
func (p *Pool) WalkDevices(fn func(Device) error) error {
	return p.walk(p.sb.DeviceDetailsRoot, 0, detailsValueSize, "device details", func(id uint64, v []byte) error {
		return fn(decodeDevice(id, v))
	})
}

// Device returns the details of thin device id.
func (p *Pool) Device(id uint64) (Device, error) {
	v, ok, err := p.lookup(p.sb.DeviceDetailsRoot, id, detailsValueSize, "device details")
	if err != nil {
		return Device{}, err
	}
	if !ok {
		return Device{}, fmt.Errorf("%w: %d", ErrUnknownDevice, id)
	}
	return decodeDevice(id, v), nil
}

// deviceRoot returns the root of thin device id's mapping btree: the
// value of id in the top level of the two-level mapping tree.
func (p *Pool) deviceRoot(id uint64) (uint64, error) {
	v, ok, err := p.lookup(p.sb.DataMappingRoot, id, blockValueSize, "mapping")
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, fmt.Errorf("%w: %d", ErrUnknownDevice, id)
	}
	return le64(v, 0), nil
}

// Lookup returns the mapping of virtual block vblock of thin device dev,
// and false if the block is not provisioned.
func (p *Pool) Lookup(dev, vblock uint64) (Mapping, bool, error) {
	root, err := p.deviceRoot(dev)
	if err != nil {
		return Mapping{}, false, err
	}
	v, ok, err := p.lookup(root, vblock, mappingValueSize, fmt.Sprintf("thin device %d mapping", dev))
	if err != nil || !ok {
		return Mapping{}, false, err
	}
	m, err := p.decodeMapping(dev, vblock, v)
	return m, err == nil, err
}

// WalkMappings calls fn with every mapping of thin device dev from
// virtual block from on, in ascending order, until fn returns an error,
// which it returns. A caller that walks in pieces resumes at the block
// after the last one it saw.
func (p *Pool) WalkMappings(dev, from uint64, fn func(Mapping) error) error {
	root, err := p.deviceRoot(dev)
	if err != nil {
		return err
	}
	return p.walk(root, from, mappingValueSize, fmt.Sprintf("thin device %d mapping", dev), func(vblock uint64, v []byte) error {
		m, err := p.decodeMapping(dev, vblock, v)
		if err != nil {
			return err
		}
		return fn(m)
	})
}
