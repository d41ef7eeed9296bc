package main

// The host role: one connection registered for calls and subscribed to events, reconnected whenever it
// drops. Each session action or code review is performed once per call id (the journal dedupes), and the
// event subscription resumes after the last event_seq received.

import (
	"context"
	"encoding/json"
	"sync"
	"time"
)

// host answers the server's calls and follows its events.
type host struct {
	cfg     config
	journal *journal
	events  *eventLog
	stop    context.Context // ends when the host stops: a call's pending reply delay is cut short

	mu       sync.Mutex
	stopping bool           // no new call is taken
	calls    sync.WaitGroup // calls being handled
}

// run keeps a host session up until ctx ends, reconnecting after each drop (backing off while the server
// cannot be reached), then waits for the calls in hand.
func (h *host) run(ctx context.Context) {
	h.stop = ctx
	wait := newBackoff()
	for ctx.Err() == nil {
		err := h.session(ctx, wait)
		if ctx.Err() != nil {
			break
		}
		if wait.failures == 0 { // logged once a streak: then retried quietly until it connects
			logf("warn", "host_disconnected", "error", err.Error())
		}
		wait.sleep(ctx)
	}
	h.drain()
}

// drain takes no more calls and waits for those in hand to be answered.
func (h *host) drain() {
	h.mu.Lock()
	h.stopping = true
	h.mu.Unlock()
	h.calls.Wait()
}

// session registers one connection as a host, subscribes it to the events (resuming after the last one
// received, when the server numbers them) and serves it until it drops or ctx ends.
func (h *host) session(ctx context.Context, wait *backoff) error {
	c, err := dial(h.cfg.socket, handlers{call: h.onCall, event: h.events.add, gap: h.events.addGap})
	if err != nil {
		return err
	}
	defer c.close()
	setup, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	r, err := c.request(setup, map[string]any{"type": "register_host", "capabilities": h.cfg.capabilities})
	if err == nil {
		err = r.err()
	}
	if err != nil {
		return err
	}
	var registered struct {
		HostID string `json:"host_id"`
	}
	if err := json.Unmarshal(r.Result, &registered); err != nil {
		return err
	}
	after := h.events.resumeAfter()
	subscribe := map[string]any{"type": "subscribe"}
	if after > 0 {
		subscribe["after"] = after
	}
	r, err = c.request(setup, subscribe)
	if err == nil && r.refused("after") { // a server that cannot resume: events from now on
		logf("warn", "events_not_resumable", "after", after)
		r, err = c.request(setup, map[string]any{"type": "subscribe"})
	}
	if err == nil {
		err = r.err()
	}
	if err != nil {
		return err
	}
	logf("info", "host_registered", "host_id", registered.HostID, "capabilities", h.cfg.capabilities,
		"resumed_after", after)
	wait.reset()
	select {
	case <-c.done:
		return c.err
	case <-ctx.Done():
		// Stopping: answer the calls in hand, then close. Calls sent after this are never answered by this
		// host: the server offers them again to the next one, under the same ids.
		h.drain()
		return nil
	}
}

// onCall starts handling one call; it runs on the connection's reading goroutine, so it does not wait.
func (h *host) onCall(c *conn, cl call) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stopping {
		return // unanswered, the call goes to the next host
	}
	h.calls.Add(1)
	go func() {
		defer h.calls.Done()
		h.handle(c, cl)
	}()
}

// handle performs the call once (or finds it performed already) and answers it.
func (h *host) handle(c *conn, cl call) {
	answer := map[string]any{"type": "host_reply", "call_id": cl.CallID, "ok": true}
	switch cl.Kind {
	case "session_action", "code_review":
		if !h.journal.begin(cl.CallID) {
			logf("info", "call_already_done", "call_id", cl.CallID)
			break
		}
		entry, err := perform(cl)
		if err == nil {
			err = h.journal.end(cl.CallID, entry)
		} else {
			h.journal.end(cl.CallID, nil)
		}
		if err != nil {
			logf("error", "call_failed", "call_id", cl.CallID, "error", err.Error())
			answer["ok"] = false
			answer["error"] = map[string]any{"code": "host_error", "message": err.Error(), "retryable": true}
			break
		}
		logf("info", "call_performed", "call_id", cl.CallID, "kind", cl.Kind)
		if h.cfg.replyDelay > 0 { // performed and recorded, not yet answered: a crash here is survived
			delay := time.NewTimer(h.cfg.replyDelay)
			defer delay.Stop()
			select {
			case <-delay.C:
			case <-h.stop.Done():
				return // unanswered: offered again to the next host, which finds it done
			}
		}
	default: // not registered for it: the server sends none
		answer["ok"] = false
		answer["error"] = map[string]any{"code": "unsupported", "message": "this host does not do " + cl.Kind}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := c.request(ctx, answer)
	if err == nil {
		err = r.err()
	}
	if err != nil {
		// conflict: the call ended meanwhile (timed out, or the server stopped); it is the runtime's now.
		logf("warn", "answer_not_taken", "call_id", cl.CallID, "error", err.Error())
	}
}

// perform does what a call asks, returning its journal entry. In this example a session action or a
// review start is only recorded; a real host would act on its session (start the agent, switch its mode)
// and record the call id in the same transaction as the effect, or make the effect itself idempotent.
func perform(cl call) (map[string]any, error) {
	var req struct {
		TaskID         string          `json:"task_id"`
		SessionID      *string         `json:"session_id"`
		StepID         string          `json:"step_id"`
		Action         string          `json:"action"`
		Config         json.RawMessage `json:"config"`
		AdmissionSeq   *int64          `json:"admission_seq"`
		ReviewRunID    *int64          `json:"review_run_id"`
		AgentProfileID *string         `json:"agent_profile_id"`
	}
	if err := json.Unmarshal(cl.Request, &req); err != nil {
		return nil, err
	}
	entry := map[string]any{"what": cl.Kind, "call_id": cl.CallID, "task_id": req.TaskID, "step_id": req.StepID}
	if cl.Kind == "session_action" {
		entry["action"] = req.Action
		entry["session_id"] = req.SessionID
		entry["config"] = req.Config
		entry["admission_seq"] = req.AdmissionSeq
	} else {
		entry["review_run_id"] = req.ReviewRunID
		entry["agent_profile_id"] = req.AgentProfileID
	}
	return entry, nil
}
