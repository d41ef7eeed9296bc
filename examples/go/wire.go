package main

// The wire: one connection to `onceflow serve`, JSON lines each way (docs/protocol.md, "Over a socket").
// Requests carry an integer id and are matched to their replies by it: replies to one connection's commands
// come in order, but the reply to a host_reply may overtake them.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"time"
)

const (
	// maxLine bounds one line read from the server. The server never sends a line larger than its
	// --queue-bytes (8 MiB by default).
	maxLine = 16 << 20
	// writeTimeout bounds one write: a server that stops reading for this long is treated as gone.
	writeTimeout = 10 * time.Second
)

// errorInfo is the protocol's ErrorInfo: why a request was refused, or why the server closed a connection.
type errorInfo struct {
	Code      string `json:"code"`
	Message   string `json:"message"`
	Field     string `json:"field,omitempty"`
	Retryable bool   `json:"retryable"`
}

func (e *errorInfo) Error() string { return e.Code + ": " + e.Message }

// reply is the protocol's Reply, as far as this host reads it.
type reply struct {
	Command string          `json:"command"`
	OK      bool            `json:"ok"`
	Result  json.RawMessage `json:"result"`
	Error   *errorInfo      `json:"error"`
}

// err is nil for an ok reply, else the refusal.
func (r reply) err() error {
	if r.OK {
		return nil
	}
	if r.Error == nil {
		return fmt.Errorf("%s refused without an error", r.Command)
	}
	return r.Error
}

// call is one call the server offers a host: answer it with a host_reply naming CallID before Deadline.
type call struct {
	CallID   string          `json:"call_id"`
	Kind     string          `json:"kind"`
	Request  json.RawMessage `json:"request"`
	Deadline string          `json:"deadline"`
}

// gap says the events after After and before Next may be missing (a subscription resumed too late).
type gap struct {
	After int64 `json:"after"`
	Next  int64 `json:"next"`
}

// frame is any line the server sends: a reply, a call, an event, a gap marker or a connection error.
type frame struct {
	ID       json.RawMessage `json:"id"`
	Reply    *reply          `json:"reply"`
	Call     *call           `json:"call"`
	EventSeq *int64          `json:"event_seq"` // absent from servers without resumable subscriptions
	Event    json.RawMessage `json:"event"`
	Gap      *gap            `json:"gap"`
	Error    *errorInfo      `json:"error"`
}

// handlers take what the server sends besides replies. They run on the connection's reading goroutine, in
// the order the lines came, and must return quickly: a client that stops reading is disconnected.
type handlers struct {
	call  func(c *conn, cl call)
	event func(seq *int64, line []byte)
	gap   func(g gap)
}

// conn is one connection to the server.
type conn struct {
	nc    net.Conn
	h     handlers
	wmu   sync.Mutex // one line written at a time
	mu    sync.Mutex // guards next and waits
	next  int64
	waits map[int64]chan reply
	done  chan struct{} // closed once the reading goroutine has ended
	err   error         // why it ended; set before done is closed
}

// dial connects to the server's socket and starts reading it.
func dial(path string, h handlers) (*conn, error) {
	nc, err := net.DialTimeout("unix", path, 5*time.Second)
	if err != nil {
		return nil, err
	}
	c := &conn{nc: nc, h: h, waits: map[int64]chan reply{}, done: make(chan struct{})}
	go c.read()
	return c, nil
}

// close ends the connection; requests waiting for a reply return an error.
func (c *conn) close() { c.nc.Close() }

func (c *conn) read() {
	defer close(c.done)
	scanner := bufio.NewScanner(c.nc)
	scanner.Buffer(make([]byte, 64<<10), maxLine)
	var closing error
	for closing == nil && scanner.Scan() {
		line := scanner.Bytes()
		var f frame
		if err := json.Unmarshal(line, &f); err != nil {
			closing = fmt.Errorf("unreadable line from the server: %w", err)
			break
		}
		switch {
		case f.Reply != nil:
			c.deliver(f.ID, *f.Reply)
		case f.Call != nil && c.h.call != nil:
			c.h.call(c, *f.Call)
		case f.Event != nil && c.h.event != nil:
			c.h.event(f.EventSeq, append([]byte(nil), line...)) // the scanner reuses its buffer
		case f.Gap != nil && c.h.gap != nil:
			c.h.gap(*f.Gap)
		case f.Error != nil:
			// The last line before the server closes the connection (slow_consumer, busy, evicted, ...).
			closing = fmt.Errorf("the server closed the connection: %w", f.Error)
		}
	}
	if closing == nil {
		closing = scanner.Err()
	}
	if closing == nil {
		closing = io.EOF
	}
	c.nc.Close()
	c.err = closing
}

// deliver hands a reply to the request waiting for it.
func (c *conn) deliver(rawID json.RawMessage, r reply) {
	id, err := strconv.ParseInt(string(rawID), 10, 64)
	if err != nil {
		logf("warn", "reply_without_request", "id", string(rawID), "command", r.Command)
		return
	}
	c.mu.Lock()
	ch, ok := c.waits[id]
	delete(c.waits, id)
	c.mu.Unlock()
	if ok {
		ch <- r // buffered: never blocks the reader
	}
}

// request sends req (a command object; its "id" is set here) and waits for its reply, the connection's end
// or ctx. A reply that is not ok is returned as a reply, not as an error.
func (c *conn) request(ctx context.Context, req map[string]any) (reply, error) {
	ch := make(chan reply, 1)
	c.mu.Lock()
	c.next++
	id := c.next
	c.waits[id] = ch
	c.mu.Unlock()
	forget := func() {
		c.mu.Lock()
		delete(c.waits, id)
		c.mu.Unlock()
	}
	req["id"] = id
	if err := c.write(req); err != nil {
		forget()
		return reply{}, err
	}
	select {
	case r := <-ch:
		return r, nil
	case <-c.done:
		select {
		case r := <-ch: // the reply came just before the end
			return r, nil
		default:
			return reply{}, c.err
		}
	case <-ctx.Done():
		forget()
		return reply{}, ctx.Err()
	}
}

// write sends one line.
func (c *conn) write(v any) error {
	line, err := json.Marshal(v)
	if err != nil {
		return err
	}
	line = append(line, '\n')
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.nc.SetWriteDeadline(time.Now().Add(writeTimeout)); err != nil {
		return err
	}
	_, err = c.nc.Write(line)
	return err
}

// refused reports whether r refuses its request because of the named field.
func (r reply) refused(field string) bool {
	return !r.OK && r.Error != nil && r.Error.Field == field
}
