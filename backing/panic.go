package backing

import (
	"errors"
	"fmt"
	"runtime/debug"
)

// ErrPanic is wrapped by the error a device call returns when it panicked
// and Recover or Guard turned the panic into an error. nbdtarget answers it
// with EIO, like any other device failure.
var ErrPanic = errors.New("panic in device call")

// Recover turns a panic in the function that defers it into an error. Defer
// it directly, so that its recover sees the panic:
//
//	func (t *tracked) WriteAt(p []byte, off int64) (n int, err error) {
//		defer backing.Recover(&err, t.Name(), t.e.OnPanic)
//		return t.Device.WriteAt(p, off)
//	}
//
// On a panic it calls onPanic (if set) with the value and the panicking
// goroutine's stack, and sets *err to an error wrapping ErrPanic that names
// the device. Without a panic it does nothing. It allocates nothing on the
// normal path, so hot paths can use it; Guard is the same for a closure.
//
// Every goroutine the engines start that calls into a device is protected
// this way: a panic there would otherwise end the process, and with it every
// connection of every export.
func Recover(err *error, device string, onPanic func(v any, stack []byte)) {
	v := recover()
	if v == nil {
		return
	}
	stack := debug.Stack()
	if onPanic != nil {
		onPanic(v, stack)
	}
	*err = fmt.Errorf("%s: %w: %v", device, ErrPanic, v)
}

// Guard calls fn and returns its error, or the error Recover makes of a
// panic in fn.
func Guard(device string, onPanic func(v any, stack []byte), fn func() error) (err error) {
	defer Recover(&err, device, onPanic)
	return fn()
}
