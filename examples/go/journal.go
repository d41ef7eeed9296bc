package main

// The host's own durable state, in two append-only files of JSON lines:
//
//   - the journal (-out): one line per effect, written and fsynced before the call is answered. Read back at
//     start it is the set of call ids already performed, so a call offered again (after this host died
//     between performing it and answering it) is answered without acting twice.
//   - the event log (-events): every event line as received; its last event_seq is where a restarted host
//     resumes its subscription.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"time"
)

// journal records effects and remembers which calls were performed.
type journal struct {
	mu   sync.Mutex
	f    *os.File
	done map[string]bool          // call ids performed (this process or an earlier one)
	busy map[string]chan struct{} // call ids being performed now; closed when that ends
}

// openJournal reads the call ids already recorded in path, then opens it for appending.
func openJournal(path string) (*journal, error) {
	j := &journal{done: map[string]bool{}, busy: map[string]chan struct{}{}}
	err := eachLine(path, func(line []byte) error {
		var entry struct {
			CallID string `json:"call_id"`
		}
		if err := json.Unmarshal(line, &entry); err != nil {
			return err
		}
		if entry.CallID != "" {
			j.done[entry.CallID] = true
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	j.f, err = os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	return j, err
}

// begin reports whether the caller must perform the call: false when it was performed already. While
// another goroutine performs the same call (offered again on a new connection), begin waits for it.
// Every begin that returns true must be followed by end.
func (j *journal) begin(callID string) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	for {
		if j.done[callID] {
			return false
		}
		running, busy := j.busy[callID]
		if !busy {
			j.busy[callID] = make(chan struct{})
			return true
		}
		j.mu.Unlock()
		<-running
		j.mu.Lock()
	}
}

// end closes a begin: with an entry, the call is recorded as performed (durably, before end returns);
// with nil, or if the record cannot be written, it is not, and the error says why.
func (j *journal) end(callID string, entry map[string]any) error {
	var err error
	if entry != nil {
		err = j.record(entry)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if entry != nil && err == nil {
		j.done[callID] = true
	}
	close(j.busy[callID])
	delete(j.busy, callID)
	return err
}

// record appends one entry (stamped with the time and this process) and fsyncs it.
func (j *journal) record(entry map[string]any) error {
	entry["at"] = time.Now().UTC().Format(time.RFC3339Nano)
	entry["pid"] = os.Getpid()
	line, err := json.Marshal(entry)
	if err != nil {
		return err
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, err := j.f.Write(append(line, '\n')); err != nil {
		return err
	}
	return j.f.Sync()
}

// eventLog keeps the events received and the last event_seq seen (the resume point).
type eventLog struct {
	mu   sync.Mutex
	f    *os.File // nil: events are not written anywhere
	last int64    // the last event_seq received; 0: none
}

// openEventLog reads the last event_seq recorded in path ("" for no file), then opens it for appending.
func openEventLog(path string) (*eventLog, error) {
	l := &eventLog{}
	if path == "" {
		return l, nil
	}
	err := eachLine(path, func(line []byte) error {
		var f frame
		if err := json.Unmarshal(line, &f); err != nil {
			return err
		}
		if f.EventSeq != nil {
			l.last = *f.EventSeq
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	l.f, err = os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	return l, err
}

// add records one event line; seq is its event_seq (nil from a server that sends none).
func (l *eventLog) add(seq *int64, line []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if seq != nil {
		l.last = *seq
	}
	l.write(line)
}

// addGap records a gap marker: the events between g.After and g.Next may never come.
func (l *eventLog) addGap(g gap) {
	logf("warn", "events_missed", "after", g.After, "next", g.Next)
	line, _ := json.Marshal(map[string]gap{"gap": g})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.write(line)
}

func (l *eventLog) write(line []byte) {
	if l.f == nil {
		return
	}
	// No fsync: a host that crashes loses at most the tail, and resumes from the last line it kept.
	if _, err := l.f.Write(append(line, '\n')); err != nil {
		logf("error", "event_log_write_failed", "error", err.Error())
	}
}

// resumeAfter is the event_seq to resume after; 0 when none was seen.
func (l *eventLog) resumeAfter() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.last
}

// eachLine calls fn with each non-empty line of path; a missing file has none. A last line cut short (the
// process died while writing it) is skipped.
func eachLine(path string, fn func(line []byte) error) error {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	scanner := bufio.NewScanner(f)
	scanner.Buffer(make([]byte, 64<<10), maxLine)
	var broken error
	for scanner.Scan() {
		if broken != nil {
			return broken // a bad line that was not the last
		}
		if line := scanner.Bytes(); len(line) > 0 {
			if err := fn(line); err != nil {
				broken = fmt.Errorf("%s: %w", path, err)
			}
		}
	}
	return scanner.Err()
}
