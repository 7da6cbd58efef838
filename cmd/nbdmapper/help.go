package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

// A verbHelp is what `nbdmapper VERB --help` prints before the verb's
// flags, as `dmsetup help` and nbdkit's per-plugin --help do: the
// arguments, what the verb does and one example. docs/man/nbdmapper.8.md
// says the same at length.
type verbHelp struct {
	name, args, summary, example string
}

var verbHelps = []verbHelp{
	{"serve", "[flags] [NAME=TABLE_FILE ...]",
		"Serve each table as the NBD export NAME (with --tables, every NAME.table in DIR);\nwith no arguments at all, create and serve a demo table.",
		"nbdmapper serve --socket /run/nbd.sock disk=disk.table"},
	{"create", "[--control PATH] NAME TABLE_FILE", "Make and serve the device NAME from TABLE_FILE on a running server.",
		"nbdmapper create scratch scratch.table"},
	{"remove", "[--control PATH] [--force] NAME", "Stop serving NAME and close its devices.",
		"nbdmapper remove scratch"},
	{"reload", "[--control PATH] NAME TABLE_FILE", "Load TABLE_FILE as NAME's inactive table; resume makes it live.",
		"nbdmapper reload disk bigger.table && nbdmapper suspend disk && nbdmapper resume disk"},
	{"suspend", "[--control PATH] NAME", "Finish NAME's requests in flight, flush it and hold new I/O.",
		"nbdmapper suspend disk"},
	{"resume", "[--control PATH] NAME", "Make NAME's inactive table live, if any, and release its I/O.",
		"nbdmapper resume disk"},
	{"clear", "[--control PATH] NAME", "Drop NAME's inactive table.",
		"nbdmapper clear disk"},
	{"table", "[--control PATH] [--inactive] NAME", "Print NAME's table, as dmsetup table does.",
		"nbdmapper table --inactive disk"},
	{"info", "[--control PATH] NAME", "Print NAME's state: live or suspended, tables loaded, clients.",
		"nbdmapper info disk"},
	{"ls", "[--control PATH]", "List the devices of a running server.",
		"nbdmapper ls"},
	{"message", "[--control PATH] NAME SECTOR TEXT", "Send a message to the target of NAME's table that covers SECTOR\n(no target takes messages yet: it fails, naming the device).",
		"nbdmapper message disk 0 drop_cache"},
	{"check", "[--connect] TABLE_FILE", "Validate a table and print it normalised; with --connect, also open the\nremote exports it names and check their sizes.",
		"nbdmapper check /etc/nbdmapper/tables/disk.table"},
	{"status", "[--table] [--metrics HOST:PORT|URL] [flags]", "Print every device's status lines (or, with --table, its table) from a\nrunning server, as dmsetup status does, and how far each snapshot-merge is.",
		"nbdmapper status --metrics 127.0.0.1:9810"},
	{"wait", "[--interval D] [--control PATH] NAME", "Follow NAME's snapshot-merge until it ends, as lvconvert --merge -i does:\na progress bar on a terminal, else a line per interval; exit 1 if it fails.",
		"nbdmapper wait --interval 5s disk"},
	{"attach", "[flags] (--socket PATH | --connect HOST:PORT) [--export NAME] /dev/nbdX", "Connect an export to a kernel nbd device, in the foreground until detached.",
		"nbdmapper attach --socket /run/nbd.sock --export disk /dev/nbd0"},
	{"detach", "/dev/nbdX", "Disconnect a kernel nbd device.",
		"nbdmapper detach /dev/nbd0"},
	{"version", "", "Print the version, VCS revision and Go version the binary was built from.",
		"nbdmapper version"},
	{"help", "[VERB]", "Print the usage of every verb, or VERB's help.",
		"nbdmapper help serve"},
}

func lookupHelp(name string) (verbHelp, bool) {
	for _, h := range verbHelps {
		if h.name == name {
			return h, true
		}
	}
	return verbHelp{}, false
}

// helpWanted is set when the command line asks for help (-h, -help,
// --help): the verb's flag set then prints its usage to stdout, and the
// exit status is 0, as for any program asked for its help.
var helpWanted bool

// newFlagSet is the flag set of one verb, whose usage is that verb's help.
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	if helpWanted {
		fs.SetOutput(os.Stdout)
	}
	fs.Usage = func() { printVerbHelp(fs.Output(), name, fs) }
	return fs
}

// printVerbHelp writes the verb's usage line, summary, example and
// flags.
func printVerbHelp(w io.Writer, name string, fs *flag.FlagSet) {
	h, _ := lookupHelp(name)
	fmt.Fprintf(w, "usage: nbdmapper %s %s\n\n%s\n\nexample:\n  %s\n", name, h.args, h.summary, h.example)
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	if n > 0 {
		fmt.Fprintf(w, "\nflags:\n")
		fs.PrintDefaults()
	}
	fmt.Fprintf(w, "\nSee nbdmapper(8).\n")
}

// isHelpFlag: the spellings of -h the flag package takes.
func isHelpFlag(arg string) bool {
	switch arg {
	case "-h", "-help", "--h", "--help":
		return true
	}
	return false
}

// asksHelp reports whether args, a verb's arguments, ask for help before
// any "--" that ends the flags.
func asksHelp(args []string) bool {
	for _, a := range args {
		if a == "--" {
			return false
		}
		if isHelpFlag(a) {
			return true
		}
	}
	return false
}

// runHelp prints the usage of every verb, or one verb's help.
func runHelp(args []string) error {
	fs := newFlagSet("help")
	if err := fs.Parse(args); err != nil {
		return err
	}
	switch fs.NArg() {
	case 0:
		fmt.Print(usage)
		return nil
	case 1:
		run, ok := commands[fs.Arg(0)]
		if !ok {
			return unknownVerb(fs.Arg(0))
		}
		helpWanted = true
		if err := run([]string{"--help"}); err != flag.ErrHelp {
			return err
		}
		return nil
	}
	return fmt.Errorf("help takes at most one VERB")
}

// unknownVerb is the error for a verb that does not exist, naming the
// nearest one when it is a likely typo.
func unknownVerb(name string) error {
	msg := fmt.Sprintf("unknown verb %q", name)
	if near := nearestVerb(name); near != "" {
		msg += fmt.Sprintf("; did you mean %q?", near)
	}
	return fmt.Errorf("%s (nbdmapper help lists the verbs)", msg)
}

// nearestVerb is the verb that name is a prefix of, or else the one at the
// least edit distance from name when that is at most a third of its
// length (at least 1): "stauts" finds status, "xyz" finds nothing.
func nearestVerb(name string) string {
	best, bestD := "", 0
	for _, h := range verbHelps {
		if len(name) >= 2 && strings.HasPrefix(h.name, name) {
			return h.name
		}
		d := editDistance(name, h.name)
		if best == "" || d < bestD {
			best, bestD = h.name, d
		}
	}
	if bestD > max(1, len(name)/3) {
		return ""
	}
	return best
}

// editDistance is the optimal string alignment distance: insertions,
// deletions, substitutions and swaps of neighbours each cost 1, so the
// usual typos (a letter missed, doubled, wrong or swapped) cost 1.
func editDistance(a, b string) int {
	d := make([][]int, len(a)+1)
	for i := range d {
		d[i] = make([]int, len(b)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(a)][len(b)]
}
