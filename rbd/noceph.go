//go:build !ceph

package rbd

import "github.com/nbdmapper/nbdmapper/backing"

// Supported says whether this binary can open rbd: devices: it was built
// with `-tags ceph`.
const Supported = false

func open(name string, _ Name, _ bool, _ Options) (backing.Device, error) {
	return nil, ErrNoCeph
}
