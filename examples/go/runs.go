package main

// Runs: for each agent profile, one worker on a connection of its own claims runs with a lease (a long
// poll: claim_run with wait_seconds), renews the lease while it works, and finishes the run with the claim
// token. A worker that dies holding a run loses nothing: the lease expires and the run is claimed again,
// with a new token; the dead worker's token is refused from then on.

import (
	"context"
	"encoding/json"
	"errors"
	"time"
)

// claimedRun is what claim_run returns, as far as this host reads it.
type claimedRun struct {
	ID             int64           `json:"id"`
	AgentProfileID string          `json:"agent_profile_id"`
	TaskID         *string         `json:"task_id"`
	StepID         *string         `json:"step_id"`
	Reason         string          `json:"reason"`
	Payload        json.RawMessage `json:"payload"`
	Attempt        int             `json:"attempt"`
	ClaimToken     string          `json:"claim_token"`
}

// worker claims and works the runs of one agent profile.
type worker struct {
	cfg     config
	agent   string
	journal *journal
}

// run claims, works and finishes runs until ctx ends, reconnecting after each drop. A run in hand when
// ctx ends is handed back (handBack), so another worker can take it without waiting for its lease.
func (w *worker) run(ctx context.Context) {
	wait := newBackoff()
	for ctx.Err() == nil {
		err := w.session(ctx, wait)
		if ctx.Err() != nil {
			return
		}
		if wait.failures == 0 {
			logf("warn", "worker_disconnected", "agent_profile_id", w.agent, "error", err.Error())
		}
		wait.sleep(ctx)
	}
}

func (w *worker) session(ctx context.Context, wait *backoff) error {
	c, err := dial(w.cfg.socket, handlers{})
	if err != nil {
		return err
	}
	defer c.close()
	for ctx.Err() == nil {
		// The long poll is not cut short by ctx: a claim abandoned mid-wait could still take a run that
		// nobody would work until its lease ran out. It ends within wait_seconds.
		poll, cancel := context.WithTimeout(context.Background(), w.cfg.wait+30*time.Second)
		r, err := c.request(poll, map[string]any{
			"type":             "claim_run",
			"agent_profile_id": w.agent,
			"lease_seconds":    w.cfg.lease.Seconds(),
			"wait_seconds":     w.cfg.wait.Seconds(),
		})
		cancel()
		if err == nil {
			err = r.err()
		}
		if err != nil {
			return err
		}
		wait.reset()
		if string(r.Result) == "null" {
			continue // none within wait_seconds
		}
		var run claimedRun
		if err := json.Unmarshal(r.Result, &run); err != nil {
			return err
		}
		if err := w.work(ctx, c, run); err != nil {
			return err
		}
	}
	return nil
}

// errLost means the claim is no longer this worker's (its lease expired and the run was claimed again, or
// it was cancelled): stop working it, and never finish it.
var errLost = errors.New("claim lost")

// work "works" the run for cfg.work, renewing its lease every third of it, then finishes it. The error is
// only the connection's; a lost claim is logged and skipped.
func (w *worker) work(ctx context.Context, c *conn, run claimedRun) error {
	logf("info", "run_claimed", "run_id", run.ID, "agent_profile_id", run.AgentProfileID,
		"attempt", run.Attempt, "reason", run.Reason)
	renewals, superseded := 0, false
	done := time.NewTimer(w.cfg.work)
	defer done.Stop()
	renew := time.NewTicker(w.cfg.lease / 3)
	defer renew.Stop()
	for working := true; working; {
		select {
		case <-done.C:
			working = false
		case <-ctx.Done():
			return w.handBack(c, run)
		case <-renew.C:
			var renewed struct {
				Superseded bool `json:"superseded"`
			}
			err := w.send(c, map[string]any{
				"type": "renew_run", "run_id": run.ID, "claim_token": run.ClaimToken,
				"lease_seconds": w.cfg.lease.Seconds(),
			}, &renewed)
			if errors.Is(err, errLost) {
				logf("warn", "run_lost", "run_id", run.ID, "attempt", run.Attempt)
				return nil
			}
			if err != nil {
				return err
			}
			renewals++
			// Its task left the step entry that queued it: the work is no longer wanted.
			superseded, working = renewed.Superseded, !renewed.Superseded
		}
	}
	var finished struct {
		Status string `json:"status"`
		Replay bool   `json:"replay"`
	}
	err := w.send(c, map[string]any{
		"type": "finish_run", "run_id": run.ID, "claim_token": run.ClaimToken, "status": "finished",
	}, &finished)
	if errors.Is(err, errLost) {
		logf("warn", "run_lost", "run_id", run.ID, "attempt", run.Attempt)
		return nil
	}
	if err != nil {
		return err
	}
	logf("info", "run_finished", "run_id", run.ID, "status", finished.Status, "renewals", renewals)
	return w.journal.record(map[string]any{
		"what": "run_finished", "run_id": run.ID, "agent_profile_id": run.AgentProfileID,
		"task_id": run.TaskID, "step_id": run.StepID, "reason": run.Reason, "attempt": run.Attempt,
		"renewals": renewals, "superseded": superseded, "status": finished.Status,
	})
}

// handBack gives the run up: the host is stopping, the work did not fail. requeue_run returns it to the
// queue in its place in line, fenced by its claim token: claimable again at once, and no failed attempt
// counts against its retries (a failed finish would).
func (w *worker) handBack(c *conn, run claimedRun) error {
	err := w.send(c, map[string]any{
		"type": "requeue_run", "run_id": run.ID, "claim_token": run.ClaimToken,
	}, nil)
	if err != nil && !errors.Is(err, errLost) {
		return err
	}
	logf("info", "run_handed_back", "run_id", run.ID, "attempt", run.Attempt)
	return nil
}

// send makes one request about a claimed run and decodes its result into out (nil: ignored). A refusal
// naming claim_token is errLost; any other error is the connection's or the server's.
func (w *worker) send(c *conn, req map[string]any, out any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := c.request(ctx, req)
	if err != nil {
		return err
	}
	if r.refused("claim_token") {
		return errLost
	}
	if err := r.err(); err != nil {
		return err
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(r.Result, out)
}
