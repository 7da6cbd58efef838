package table

import (
	"errors"
	"fmt"
)

// Sentinel errors a caller can test with errors.Is. Parse wraps them in an
// *Error that names the file and line.
var (
	ErrEmpty         = errors.New("table has no targets")
	ErrGap           = errors.New("gap or overlap: line does not start where the previous one ended")
	ErrZeroLength    = errors.New("zero length")
	ErrUnknownTarget = errors.New("unknown target type")
	ErrArgCount      = errors.New("wrong number of arguments")
	ErrNumber        = errors.New("bad number")
	ErrStriped       = errors.New("striped geometry")
	ErrBeyondDevice  = errors.New("mapped area beyond the end of the device")
	ErrDevice        = errors.New("cannot open device")
	ErrTooMany       = errors.New("too many targets")
	ErrLineTooLong   = errors.New("line too long")
)

// Error is a table error with its position: "FILE:LINE: reason".
type Error struct {
	File string
	Line int // 1-based; 0 when the error is about the whole table
	Err  error
}

func (e *Error) Error() string {
	if e.Line == 0 {
		return fmt.Sprintf("%s: %v", e.File, e.Err)
	}
	return fmt.Sprintf("%s:%d: %v", e.File, e.Line, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }
