package nbdtarget

import (
	"context"

	"golang.org/x/sync/semaphore"

	"github.com/nbdmapper/nbdmapper/internal/signal"
)

// An export's budget (ExportMemory) keeps one export whose device hangs
// from holding all of Memory, but two such exports, at the default of
// half, hold it all between them, and every other export's requests would
// then wait for memory that only the hung devices can give back. So a
// quarter of Memory is kept in reserve: a request that finds the rest all
// taken is charged to the reserve instead if no other request of its
// export is on it. Every export then keeps getting a request at a time
// through, until exports whose devices hang hold the whole reserve, one
// request each.

// splitMemory divides a server's memory between what every request may
// take and the reserve: a quarter to the reserve, or less where the rest
// would not hold the largest request (below 4/3 of its cost; none at it).
func splitMemory(memory int64) (common, reserve int64) {
	common = max(memory-memory/4, min(memory, maxCost))
	return common, memory - common
}

// memReserve is a server's reserve.
type memReserve struct {
	sem   *semaphore.Weighted
	freed signal.Signal // fires whenever a request on the reserve ends
}

func newMemReserve(n int64) *memReserve { return &memReserve{sem: semaphore.NewWeighted(n)} }

// exportBudget is an export's memory on one server (ExportMemory) and its
// turn on the server's reserve.
type exportBudget struct {
	*semaphore.Weighted
	turn chan struct{} // holds a token while one of the export's requests is on the reserve
}

func newExportBudget(n int64) *exportBudget {
	return &exportBudget{Weighted: semaphore.NewWeighted(n), turn: make(chan struct{}, 1)}
}

// awaitMemory charges n bytes for j to the server's Memory, waiting for
// them in arrival order, or to the reserve once j's export has its turn
// there and the reserve has them. Each time a request on the reserve ends
// the wait for Memory stops to try the reserve again. It fails, having
// taken nothing, once the connection is stopped.
func (c *conn) awaitMemory(j *job, n int64) error {
	r := c.srv.reserve
	for {
		changed := r.freed.C() // before trying, so that no release is missed
		select {
		case c.xmem.turn <- struct{}{}:
			if r.sem.TryAcquire(n) {
				j.reserved = true
				return nil
			}
			<-c.xmem.turn
		default:
		}
		ctx, cancel := context.WithCancel(c.stopCtx)
		go func() {
			select {
			case <-changed:
				cancel()
			case <-ctx.Done():
			}
		}()
		err := c.srv.mem.Acquire(ctx, n)
		cancel()
		if err == nil {
			return nil
		}
		if err := c.stopCtx.Err(); err != nil {
			return err
		}
	}
}
