package backing

import (
	"errors"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestGuard(t *testing.T) {
	cases := []struct {
		name      string
		fn        func() error
		want      error  // errors.Is target; nil: no error
		msg       string // in the error's text
		reported  bool   // onPanic called
		stackHas  string
		valueText string
	}{
		{"returns nil", func() error { return nil }, nil, "", false, "", ""},
		{"passes an error through", func() error { return unix.EIO }, unix.EIO, "input/output error", false, "", ""},
		{"panic with a string", func() error { panic("boom") }, ErrPanic, "a.img: panic in device call: boom", true, "backing.TestGuard", "boom"},
		{"panic with an error", func() error { panic(unix.EIO) }, ErrPanic, "a.img: panic in device call: input/output error", true, "backing.TestGuard", "input/output error"},
		{"panic(nil)", func() error { panic(nil) }, ErrPanic, "a.img: panic in device call", true, "backing.TestGuard", "panic called with nil"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var reported bool
			var value any
			var stack string
			err := Guard("a.img", func(v any, s []byte) { reported, value, stack = true, v, string(s) }, tc.fn)
			if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("Guard = %v, want %v", err, tc.want)
			}
			if err != nil && !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("error %q does not contain %q", err, tc.msg)
			}
			if tc.want == ErrPanic && errors.Is(err, unix.EIO) {
				t.Errorf("a panic's value leaked into the error chain: %v", err)
			}
			if reported != tc.reported {
				t.Fatalf("onPanic called %v, want %v", reported, tc.reported)
			}
			if reported && (!strings.Contains(stack, tc.stackHas) || !strings.Contains(fmtValue(value), tc.valueText)) {
				t.Errorf("reported %v with stack\n%s", value, stack)
			}
			// Without a hook the panic still becomes the error.
			if err2 := Guard("a.img", nil, tc.fn); (err2 == nil) != (err == nil) {
				t.Errorf("without onPanic: %v, with: %v", err2, err)
			}
		})
	}
}

func fmtValue(v any) string {
	if e, ok := v.(error); ok {
		return e.Error()
	}
	if s, ok := v.(string); ok {
		return s
	}
	return ""
}

// Recover costs no allocation when nothing panics: the tracked device's
// writes defer it on every call.
func TestRecoverAllocatesNothing(t *testing.T) {
	write := func() (err error) {
		defer Recover(&err, "a.img", nil)
		return nil
	}
	if n := testing.AllocsPerRun(100, func() { _ = write() }); n != 0 {
		t.Fatalf("%v allocations per call", n)
	}
}
